"""``python -m mta_repro.hf export|import``: see mta_repro/hf/__init__.py."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import mta_repro.hf as _pkg
from mta_repro.errors import UserError


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m mta_repro.hf", description=_pkg.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser(
        "export",
        help="run or .pt -> LlamaForCausalLM folder (baseline) or trust_remote_code folder (MTA, talking heads, Diff)",
    )
    e.add_argument("path", help="run directory or consolidated .pt")
    e.add_argument("out_dir", help="a new or empty folder, or an earlier export (replaced)")
    e.add_argument("--force", action="store_true", help="write into a non-empty folder that is not an export")
    i = sub.add_parser("import", help="Llama checkpoint folder -> consolidated .pt of our baseline")
    i.add_argument("hf_dir")
    i.add_argument("out", help="output .pt (evaluate it, or train from it with checkpoint.init_from)")
    i.add_argument(
        "--dtype",
        default="auto",
        help="auto (default): keep the checkpoint's dtype (bf16 for Meta's); or float32, bfloat16",
    )
    args = ap.parse_args(argv)
    from mta_repro.cli import run_cli

    def go() -> int:
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            raise UserError("transformers is not installed: pip install -e '.[hf]'")
        from mta_repro.hf.convert import export_hf, import_hf

        print(
            export_hf(args.path, args.out_dir, args.force)
            if args.cmd == "export"
            else import_hf(args.hf_dir, args.out, args.dtype)
        )
        return 0

    return run_cli("hf", go)
