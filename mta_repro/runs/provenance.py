"""What a run's numbers came from: its inputs recorded at every start, in every checkpoint,
export, evaluation and Hugging Face export, and compared wherever a run goes on
(docs/provenance.md).

The inputs of a run: the tokenizer file's sha256, the training files' listing fingerprint
(``mta_repro.data``: names, sizes, mtimes; the loader state adds what identifies each file
read), the weights it started from (``checkpoint.init_from``: the sha256 of their tensors)
and the code (package version, git commit). ``<run_dir>/provenance.json`` keeps every
start, every change accepted and what the run is (``"run"``: its ``run.stage``,
``run.variant``, ``run.point``); ``<checkpoint>/provenance.json`` the inputs, step, tokens
seen and ``"run"`` of that checkpoint (``"provenance"`` in an export's ``consolidated.pt``).

Checks: a resume or a stage start refuses a tokenizer whose sha256 differs from the one
recorded, and a data file whose text the run already read changed (the loader finds it,
``TrainLoader.input_check``); evaluation refuses a tokenizer that differs from the
weights'. Each refusal is one line naming the file, what changed and the override that
accepts it (``checkpoint.accept_changed_data``/``accept_changed_tokenizer``, eval's
``accept_changed_tokenizer``); an accepted change is recorded. On several ranks, every
rank's tokenizer and data listing must be rank 0's (``rank_inputs``, ``ranks_disagree``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mta_repro.errors import UserError
from mta_repro.weights.layout import PROVENANCE

# In a run dir, a checkpoint folder (mta_repro.weights reads it with the weights), an HF export.
RECORD = PROVENANCE
EXPORT_KEY = "provenance"  # in an export's consolidated.pt
FORMAT = 1
ACCEPT_DATA = "checkpoint.accept_changed_data=true"
ACCEPT_TOKENIZER = "checkpoint.accept_changed_tokenizer=true"
ACCEPT_CONFIG = "checkpoint.allow_config_change=true"


class ProvenanceError(UserError):
    """An input changed since the run (or the weights) recorded it: one line naming the
    file, what changed and the override that accepts it."""


# ------------------------------------------------------------------ identities
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def state_digest(state: Mapping[str, Any]) -> str:
    """sha256 of a model state dict's tensors (names, dtypes, shapes and bytes, in name
    order): the same weights give the same digest whether read from a DCP checkpoint or
    from the export made of it."""
    import torch

    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key]
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{key}\t{t.dtype}\t{tuple(t.shape)}\n".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """{"package": mta_repro's version, "commit": the git commit of its checkout (None
    outside one), "dirty": whether tracked files differ from it, "source": "checkout",
    "wheel" (installed: no commit to ask) or "tree" (a source tree without git)}."""
    import mta_repro
    from mta_repro.resources import CLONE

    out = {"package": mta_repro.__version__, "commit": None, "dirty": None, "source": "wheel"}
    repo = CLONE  # None from an installed wheel: no checkout to ask
    if repo is None:
        return out
    out["source"] = "tree"
    if not (repo / ".git").exists():
        return out
    out["source"] = "checkout"
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode == 0:
            out["commit"] = head.stdout.strip()
            st = subprocess.run(
                ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            out["dirty"] = bool(st.stdout.strip()) if st.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def tokenizer_identity(tok) -> dict:
    """{"name", "path", "sha256"} of a ``data.tokenizer`` config (dataclass, dict or
    DictConfig): the resolved file and the sha256 of its bytes (None for ``bytes``, which
    has no file, or a file that is not there)."""
    from mta_repro.data.args import resolve_path

    get = tok.get if isinstance(tok, Mapping) or hasattr(tok, "get") else lambda k, d=None: getattr(tok, k, d)
    name, path = get("name", None), get("path", None)
    if name == "bytes" or not path:
        return {"name": name, "path": None, "sha256": None}
    p = resolve_path(str(path))
    return {
        "name": name,
        "path": str(p.resolve()) if p.exists() else str(path),
        "sha256": sha256_file(p) if p.is_file() else None,
    }


def tokenizer_change(recorded: Mapping | None, now: Mapping) -> str | None:
    """What differs between a recorded tokenizer identity and today's (None: the same
    content, or nothing recorded to compare with); a moved file is no change."""
    if not recorded or not recorded.get("name"):
        return None
    if recorded.get("name") != now.get("name"):
        return f"data.tokenizer.name is {now.get('name')!r}, recorded {recorded.get('name')!r}"
    old, new = recorded.get("sha256"), now.get("sha256")
    if old and new and old != new:
        return (
            f"data.tokenizer.path={now.get('path')}: its content differs from the tokenizer recorded "
            f"(sha256 {short(new)} now, {short(old)} recorded from {recorded.get('path')})"
        )
    return None


def short(digest: str | None, n: int = 12) -> str:
    return digest[:n] if digest else "?"


def validation_fingerprint(data_args) -> dict | None:
    """{"root", "layout", "files", "bytes", "sha256"} of the validation files of a data
    config's domains (names and sizes only: two copies of a corpus compare equal); None
    when there are none."""
    from mta_repro.data import to_data_args
    from mta_repro.data.args import active_sources
    from mta_repro.data.listing import corpus_root, fingerprint, list_entries

    try:
        args = to_data_args(data_args)
        entries = {e for d in active_sources(args) for e in list_entries(args, d, "validation")}
        return {"root": str(corpus_root(args)), "layout": args.layout, **fingerprint(entries, with_mtime=False)}
    except (UserError, OSError):
        return None


# ------------------------------------------------------------------ records on disk
def read_record(path: Path) -> dict | None:
    """The JSON record at ``path`` (a file, or a folder's provenance.json); None when
    there is none or it cannot be read (it says nothing then)."""
    path = Path(path)
    f = path / RECORD if path.is_dir() else path
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def weights_record(path: Path, kind: str) -> dict | None:
    """The record saved with a set of weights: a checkpoint folder's provenance.json, an
    export's ``"provenance"`` entry (read as data, memory-mapped); None if there is none."""
    if kind == "dcp":
        return read_record(path)
    from mta_repro.weights import load_pt

    try:
        blob = load_pt(path)
    except (UserError, OSError):
        return None
    rec = blob.get(EXPORT_KEY) if isinstance(blob, dict) else None
    return rec if isinstance(rec, dict) else None


def source_record(path) -> dict | None:
    """The record of the newest readable weights ``path`` offers (``find_weights``' order)."""
    from mta_repro.weights import find_weights

    try:
        found = find_weights(path)
    except (UserError, OSError):
        return None
    for c in found:
        if c.problem is None:
            return weights_record(c.path, c.kind)
    return None


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()) + " UTC"


def accepted(what: str, change: str, override: str, step: int | None) -> dict:
    """One entry of a run's ``accepted`` history."""
    return {"time": _now(), "step": step, "what": what, "change": change, "override": override}


def write_record(path: Path, obj: Any) -> None:
    """``obj`` as JSON at ``path``, whole or not at all (``mta_repro.files``)."""
    from mta_repro.files import replace_atomically

    replace_atomically(path, (json.dumps(obj, indent=1, default=str) + "\n").encode())


# ------------------------------------------------------------------ a training run
def check_tokenizer(args, run_dir: Path, latest: Path | None) -> list:
    """Rank 0, before the model is built: the tokenizer against the one the newest
    checkpoint recorded (a resume) or the one ``checkpoint.init_from``'s weights recorded
    (a stage start). Raises ProvenanceError, or returns the accepted change ([] if none)."""
    ck = args.checkpoint
    now = tokenizer_identity(args.data.tokenizer)
    if latest is not None:
        rec, what, step = read_record(latest), f"the run in {run_dir} (checkpoint {latest.name})", int(latest.name)
    elif ck.init_from:
        rec, what, step = source_record(ck.init_from), f"checkpoint.init_from={ck.init_from}", 0
    else:
        return []
    change = tokenizer_change((rec or {}).get("inputs", {}).get("tokenizer"), now)
    if change is None:
        return []
    if not ck.accept_changed_tokenizer:
        raise ProvenanceError(
            f"{change}: {what} was trained with the recorded one, so its numbers would mix two tokenizers. Use "
            f"the recorded tokenizer file, or accept this one with {ACCEPT_TOKENIZER} (recorded in "
            f"{Path(run_dir) / RECORD})"
        )
    print(
        f"[mta_repro.train] WARNING: {change}; accepted ({ACCEPT_TOKENIZER}), recorded in {Path(run_dir) / RECORD}",
        file=sys.stderr,
        flush=True,
    )
    return [accepted("tokenizer", change, ACCEPT_TOKENIZER, step)]


def rank_inputs(args, loader=None) -> dict:
    """What this rank reads, for the comparison across ranks: the tokenizer's identity
    (its file's sha256, as recorded and as eval checks it) and, once the loader exists, the
    corpus root and the fingerprint of the training files' listing (names and sizes: copies
    of a corpus on other nodes have other mtimes), from which each rank takes its share."""
    found: dict = {"tokenizer": tokenizer_identity(args.data.tokenizer)}
    inputs = loader.inputs() if loader is not None and hasattr(loader, "inputs") else None
    if isinstance(inputs, Mapping):
        train = inputs.get("train") or {}
        found["data"] = {
            "root": inputs.get("root"),
            "files": train.get("files"),
            "bytes": train.get("bytes"),
            "sha256": train.get("sha256_names_sizes"),
        }
    return found


def code_label(code: Mapping | None) -> str:
    """A run's code as the report shows it: the package version and the commit (its first 9
    hex digits, "(modified)" if tracked files differed), or why there is no commit."""
    if not code:
        return "—"
    commit = code.get("commit")
    if commit:
        return f"{code.get('package')} {short(commit, 9)}{' (modified)' if code.get('dirty') else ''}"
    why = {"wheel": " (installed from a wheel)", "tree": " (a source tree without git)"}.get(
        str(code.get("source")), ""
    )
    return f"{code.get('package')} commit unknown{why}"


def code_key(code: Mapping | None) -> tuple | None:
    """What makes two runs' code the same for the report's comparability: the version, the
    commit (None: unknown) and whether the checkout was modified; None: nothing recorded."""
    if not code:
        return None
    commit = code.get("commit")
    return (code.get("package"), commit, bool(code.get("dirty")), None if commit else code.get("source"))


def data_roots(every: list) -> list | None:
    """Each rank's corpus root, by rank, from ``rank_inputs`` of every rank (None: no rank
    had a loader that says). Ranks whose files have the same names and sizes are accepted
    (their content is not hashed at start), so the record names where every rank read."""
    roots = [((found or {}).get("data") or {}).get("root") for found in every]
    return roots if any(r is not None for r in roots) else None


def ranks_disagree(every: list) -> str | None:
    """The first rank whose ``rank_inputs`` differ from rank 0's, as one line naming it and
    both sha256 (None: every rank reads the same)."""
    first = every[0] or {}
    for r, found in enumerate(every[1:], 1):
        t0, t = first.get("tokenizer") or {}, (found or {}).get("tokenizer") or {}
        if (t.get("name"), t.get("sha256")) != (t0.get("name"), t0.get("sha256")):
            return (
                f"rank {r} reads another tokenizer than rank 0: data.tokenizer ({t.get('name')}) {t.get('path')} "
                f"has sha256 {short(t.get('sha256'))} on rank {r} and {short(t0.get('sha256'))} on rank 0 "
                f"({t0.get('name')}, {t0.get('path')}); its ids would mean other text there. Give every node "
                "the same file (or point data.tokenizer.path at a shared filesystem)"
            )
        d0, d = first.get("data"), (found or {}).get("data")
        if d0 is not None and d is not None and d.get("sha256") != d0.get("sha256"):
            return (
                f"rank {r} lists other training files than rank 0: {d.get('root')} holds {d.get('files')} files, "
                f"{d.get('bytes') or 0:,} bytes (listing sha256 {short(d.get('sha256'))}) on rank {r} and "
                f"{d0.get('files')} files, {d0.get('bytes') or 0:,} bytes ({short(d0.get('sha256'))}) on rank 0; the "
                "ranks' shares would overlap or leave files out. Give every node the same corpus (names and sizes)"
            )
    return None


def check_data(loader, accept: bool, run_dir: Path, step: int, world_size: int, is_main: bool) -> list:
    """Every rank, after the loader state was loaded: what each rank's loader found
    (``input_check``), gathered; the warnings printed once (rank 0); a refusal raised on
    every rank unless ``accept``. Returns the accepted changes (rank 0's list)."""
    found = getattr(loader, "input_check", None) or {"refuse": [], "warn": []}
    if world_size > 1:
        import torch.distributed as dist

        every: list = [None] * world_size
        dist.all_gather_object(every, found)
    else:
        every = [found]
    refuse = list(dict.fromkeys(line for f in every for line in f.get("refuse", ())))
    warn = list(dict.fromkeys(line for f in every for line in f.get("warn", ())))
    if is_main:
        for line in warn:
            print(f"[mta_repro.train] WARNING: data: {line}", file=sys.stderr, flush=True)
    if not refuse:
        return []
    more = (
        f" (and {len(refuse) - 1} more: {'; '.join(refuse[1:3])}{'; ...' if len(refuse) > 3 else ''})"
        if len(refuse) > 1
        else ""
    )
    if not accept:
        raise ProvenanceError(
            f"data: {refuse[0]}{more}. The run's earlier steps trained on the old bytes: restore the file, or "
            f"start a new run (another run_dir=), or go on with the files as they are now with {ACCEPT_DATA} "
            f"(recorded in {Path(run_dir) / RECORD})"
        )
    if hasattr(loader, "accept_input_changes"):
        loader.accept_input_changes()
    if is_main:
        print(
            f"[mta_repro.train] WARNING: data: {refuse[0]}{more}; accepted ({ACCEPT_DATA}), recorded in "
            f"{Path(run_dir) / RECORD}",
            file=sys.stderr,
            flush=True,
        )
    return [accepted("data", line, ACCEPT_DATA, step) for line in refuse]


def seed_streams(args, init_from: dict | None = None) -> dict:
    """The run's seed and every random stream it sets, with the generator each one seeds
    (``r`` is the rank): two runs whose records agree here drew the same numbers."""
    data_seed = int(args.data.seed)
    return {
        "seed": int(args.seed),
        "init": (
            {"from": init_from.get("path"), "seed": None}
            if init_from
            else {"seed": int(args.model.seed), "generator": "torch.manual_seed(model.seed)"}
        ),
        "data_order": {
            "seed": data_seed,
            "generator": "PCG64([data.seed, r, 0]) + file order PCG64([data.seed, domain, epoch])",
        },
        "shuffle_buffer": {
            "seed": data_seed,
            "generator": "PCG64([data.seed, r, 1])",
            "size": int(args.data.shuffle_buffer),
        },
        "dropout": {"seed": int(args.seed), "generator": "torch.manual_seed(seed + r)", "p": float(args.model.dropout)},
    }


def run_identity(args) -> dict:
    """{"stage", "variant", "point"} of a run's config section ``run`` (null: unrecorded;
    a config from before the section existed has none)."""
    run = getattr(args, "run", None)
    get = run.get if isinstance(run, Mapping) else lambda k: getattr(run, k, None)
    return {k: (get(k) if run is not None else None) for k in ("stage", "variant", "point")}


class RunRecord:
    """Rank 0's record of one start: the run's inputs, written to ``<run_dir>/provenance.json``
    (``begin``) and into every checkpoint (``checkpoint``)."""

    def __init__(
        self,
        args,
        run_dir: Path,
        loader,
        init_from: dict | None,
        resumed: Path | None,
        new_accepted: list,
        data_roots: list | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.resumed = resumed
        prior = read_record(resumed) if resumed is not None else None
        if init_from is None and prior is not None:  # resumed: the weights it started from are recorded
            init_from = (prior.get("inputs") or {}).get("init_from")
        run_file = read_record(self.run_dir / RECORD) or {}
        # The run's identity, made at its first start: every checkpoint, export and eval
        # result of it carries it, so a result copied into another run dir is told apart.
        self.run_id = run_file.get("run_id") or (prior or {}).get("run_id") or uuid.uuid4().hex
        history = run_file.get("accepted") or (prior or {}).get("accepted") or []
        self.accepted = list(history) + list(new_accepted)
        self.run = run_identity(args)
        self.inputs = {
            "tokenizer": tokenizer_identity(args.data.tokenizer),
            "data": loader.inputs() if hasattr(loader, "inputs") else None,
            # every rank's corpus root, by rank (data.root is rank 0's): ranks on other
            # nodes may read other copies, checked by names and sizes only
            "data_roots": data_roots,
            "init_from": init_from,
            "seeds": seed_streams(args, init_from),
            "code": code_version(),
        }

    def begin(self, step: int, world_size: int) -> None:
        """Append this start to ``<run_dir>/provenance.json`` (written atomically)."""
        path = self.run_dir / RECORD
        rec = read_record(path) or {}
        starts = list(rec.get("starts") or [])
        starts.append(
            {
                "time": _now(),
                "step": step,
                "resumed_from": str(self.resumed) if self.resumed else None,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "world_size": world_size,
                # The SLURM allocation this start ran on (None outside SLURM): which nodes
                # a multi-node run's ranks were on, e.g. "n[1-2]" and 2.
                "slurm_nodelist": os.environ.get("SLURM_JOB_NODELIST"),
                "slurm_nodes": int(os.environ["SLURM_JOB_NUM_NODES"]) if "SLURM_JOB_NUM_NODES" in os.environ else None,
                "run": self.run,
                "inputs": self.inputs,
            }
        )
        record = {"format": FORMAT, "run_id": self.run_id, "run": self.run, "starts": starts, "accepted": self.accepted}
        write_record(path, record)

    def checkpoint(self, step: int, tokens_seen: int | None) -> dict:
        """The record a checkpoint of ``step`` carries."""
        return {
            "format": FORMAT,
            "run_id": self.run_id,
            "time": _now(),
            "step": step,
            "tokens_seen": tokens_seen,
            "run": self.run,
            "inputs": self.inputs,
            "accepted": self.accepted,
        }


def foreign_result(result: Mapping, run_dir: Path) -> str | None:
    """Why an eval result found in ``run_dir`` is not a result of that run's weights, or
    None: the run identity its weights recorded (``run_id``) is another run's, or, for a
    run or a result of a version that recorded none, its attention variant is not the
    run's. A result that says nothing either way is not refused."""
    prov = result.get("provenance")
    theirs = prov.get("run_id") if isinstance(prov, Mapping) else None
    ours = (read_record(Path(run_dir) / RECORD) or {}).get("run_id")
    if theirs and ours:
        if theirs == ours:
            return None
        return f"it is a result of the weights of run {short(theirs)}, not of this run ({short(ours)})"
    variant = result.get("variant")
    cfg = Path(run_dir) / "config.yaml"
    if not variant or not cfg.is_file():
        return None
    from omegaconf import OmegaConf

    from mta_repro.model.args import attention_variant

    try:
        model = OmegaConf.to_container(OmegaConf.load(cfg), resolve=False)
    except Exception:  # noqa: BLE001 - an unreadable config says nothing here
        return None
    model = model.get("model") if isinstance(model, dict) else None
    if not isinstance(model, dict) or attention_variant(model) == variant:
        return None
    return f"it is a result of a {variant} model, and this run trains {attention_variant(model)}"


def check_own_weights(path, loaded: Path, record: Mapping | None) -> None:
    """Refuse weights read from the run dir ``path`` (or its export or a checkpoint of it)
    that another run saved (copied in from elsewhere): their ``run_id`` (``record``, saved
    with them at ``loaded``) is not the one the run dir's provenance.json gives. Weights or
    a run that recorded none, or a path outside a run dir, are not refused. ``ProvenanceError``:
    one line naming both run ids."""
    run_dir = Path(path)
    if run_dir.parent.name in ("export", "checkpoints"):  # a run's export file or checkpoint folder
        run_dir = run_dir.parent.parent
    if not run_dir.is_dir():
        return
    ours = (read_record(run_dir / RECORD) or {}).get("run_id")
    theirs = record.get("run_id") if isinstance(record, Mapping) else None
    if ours and theirs and ours != theirs:
        raise ProvenanceError(
            f"{loaded}: these weights carry run id {theirs}, but {run_dir / RECORD} says the run is {ours}: "
            "they were copied from another run; use that run's dir, or train this run again"
        )


def loaded_weights(model) -> dict:
    """What ``mta_repro.eval.load.load_model(..., identity=True)`` recorded of the weights it
    loaded (path, kind, step, sha256, tokens seen): the first block of an export's or an
    eval's provenance."""
    src = getattr(model, "source", {}) or {}
    record = src.get("record") or {}
    return {
        "path": src.get("path"),
        "kind": src.get("kind"),
        "step": src.get("step"),
        "weights_sha256": src.get("weights_sha256"),
        "tokens_seen": record.get("tokens_seen"),
    }


def weights_provenance(model, tok_cfg) -> dict:
    """The record an export of weights loaded by ``mta_repro.eval.load.load_model(...,
    identity=True)`` carries (an HF folder's provenance.json): the weights, the inputs
    their run recorded, the tokenizer exported with them, the code."""
    src = getattr(model, "source", {}) or {}
    record = src.get("record") or {}
    return {
        "format": FORMAT,
        "time": _now(),
        "weights": loaded_weights(model),
        "run": record.get("inputs"),
        "run_accepted": record.get("accepted") or [],
        "tokenizer": tokenizer_identity(tok_cfg) if tok_cfg else None,
        "code": code_version(),
    }
