"""``python -m mta_repro.release convert PATH [--name NAME] [--config-dir DIR] [--print]
[--force] [key=value ...]``: a release YAML or Lingua ``params.json`` ->
``configs/experiment/<name>.yaml`` (``mta_repro.release.config``)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from mta_repro.errors import UserError
from mta_repro.release.config import default_name, experiment_yaml, release_file_to_config


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m mta_repro.release",
        description="Convert an official-release (facebookresearch/RAM projects/mta) training YAML "
        "into configs/experiment/<name>.yaml.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="write configs/experiment/<name>.yaml from a release YAML or params.json")
    c.add_argument("path")
    c.add_argument("overrides", nargs="*", help="key=value with the release's field names, applied first")
    c.add_argument("--name", default=None, help="experiment name (default release_<file stem>)")
    c.add_argument(
        "--config-dir",
        default=None,
        help="config root to write <dir>/experiment/<name>.yaml into (default: the project's configs/)",
    )
    c.add_argument("--print", action="store_true", help="print the YAML instead of writing it")
    c.add_argument("--force", action="store_true", help="overwrite an existing file")
    a, extra = ap.parse_known_args(argv)  # key=value may also follow the options
    unknown = [x for x in extra if "=" not in x or x.startswith("-")]
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    a.overrides = list(a.overrides) + extra
    try:
        name = a.name or default_name(a.path)
        if not re.fullmatch(r"[A-Za-z0-9_\-]+", name):
            raise UserError(f"--name {name!r}: use letters, digits, '_' and '-'")
        conv = release_file_to_config(a.path, name, a.overrides)
        text = experiment_yaml(conv, name)
        if a.print:
            sys.stdout.write(text)
        else:
            from mta_repro.train.config import CONFIG_DIR

            root = Path(a.config_dir) if a.config_dir else CONFIG_DIR
            out_dir = root / "experiment"
            out = out_dir / f"{name}.yaml"
            if out.exists() and not a.force:
                raise UserError(f"{out} exists; pass --force to overwrite or --name to choose another")
            out_dir.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            print(f"wrote {out}", file=sys.stderr)
            extra = "" if a.config_dir is None else f" 'hydra.searchpath=[file://{root.resolve()}]'"
            print(f"train: python -m mta_repro.train experiment={name}{extra}", file=sys.stderr)
        for n in conv.notes:
            print(f"note: {n}", file=sys.stderr)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
