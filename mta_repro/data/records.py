"""Parsing a corpus's records: a JSON line of the release (or a parquet export's row) to its
domain's set name and document text, each bad record counted by kind (``BAD_KINDS``)."""

from __future__ import annotations

import json
import logging

from mta_repro.data.readers import OversizeRecord

log = logging.getLogger(__name__)

# Domain name -> the release's meta.redpajama_set_name.
SET_NAMES = {
    "arxiv": "RedPajamaArXiv",
    "book": "RedPajamaBook",
    "c4": "RedPajamaC4",
    "commoncrawl": "RedPajamaCommonCrawl",
    "github": "RedPajamaGithub",
    "stackexchange": "RedPajamaStackExchange",
    "wikipedia": "RedPajamaWikipedia",
}
DOMAIN_OF_SET = {v: k for k, v in SET_NAMES.items()}
BAD_KINDS = (
    "undecodable",
    "malformed_json",
    "missing_text",
    "missing_meta",
    "unknown_set",
    "empty",
    "corrupt_file",
    "oversize",
)


def _bad(counts: dict[str, int] | None, kind: str) -> None:
    if counts is not None:
        counts[kind] = counts.get(kind, 0) + 1
        n = counts[kind]
        if n <= 5 or n % 1000 == 0:
            log.warning("data: skipped a bad record (%s); %d so far", kind, n)
    return None


def record_fields(rec, with_meta: bool, counts: dict[str, int] | None) -> tuple[str | None, str] | None:
    """(set name or None, text) of a parsed record, or None for a bad one (counted)."""
    if not isinstance(rec, dict):
        return _bad(counts, "malformed_json")
    text = rec.get("text")
    if not isinstance(text, str):
        return _bad(counts, "missing_text")
    name = None
    if with_meta:
        meta = rec.get("meta")
        if isinstance(meta, str):  # parquet exports may hold meta as a JSON string
            try:
                meta = json.loads(meta)
            except ValueError:
                meta = None
        name = meta.get("redpajama_set_name") if isinstance(meta, dict) else None
        if not isinstance(name, str):
            return _bad(counts, "missing_meta")
        if name not in DOMAIN_OF_SET:
            return _bad(counts, "unknown_set")
    if not text.strip():
        return _bad(counts, "empty")
    return name, text


def parse_line(line: bytes, with_meta: bool, counts: dict[str, int] | None) -> tuple[str | None, str] | None:
    """(set name or None, text) of a JSON line, or None for a bad record (counted)."""
    if isinstance(line, OversizeRecord):
        return _bad(counts, "oversize")
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError:
        return _bad(counts, "undecodable")
    try:
        rec = json.loads(s)
    except ValueError:
        return _bad(counts, "malformed_json")
    return record_fields(rec, with_meta, counts)


def parse_record(line: bytes, set_name: str | None, counts: dict[str, int] | None) -> str | None:
    """The document text of a JSON line, or None (a bad record, counted if ``counts``, or
    a record of another domain when ``set_name`` is given)."""
    r = parse_line(line, set_name is not None, counts)
    if r is None or (set_name is not None and r[0] != set_name):
        return None
    return r[1]
