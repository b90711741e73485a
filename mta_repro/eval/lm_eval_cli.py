"""lm-eval's own command line with this project's model registered as ``mta_repro``.

    python -m mta_repro.eval.lm_eval_cli --model_args pretrained=runs/880m_mta,dtype=bfloat16 \\
        --tasks hellaswag,arc_easy --num_fewshot 0 --batch_size 16 --output_path out/
    mta-lm-eval ...                       # the same, as a console script
    torchrun --nproc_per_node 8 -m mta_repro.eval.lm_eval_cli ...   # requests split over GPUs

Every flag of ``lm_eval run`` works (``--tasks``, ``--num_fewshot``, ``--batch_size``,
``--limit``, ``--include_path``, ``--output_path``, ``--log_samples``, ...), and the
``ls``/``validate`` subcommands too. The plain ``lm_eval`` command cannot load the model:
lm-eval 0.4.13 discovers no plugins (no entry-point group), so this wrapper imports the
model class (which registers it) and then hands the arguments to lm-eval.

Defaults added here: ``--model mta_repro`` when no ``--model`` is given, and ``--device
auto`` (a GPU when there is one) instead of lm-eval's ``cuda:0``. model_args of
``mta_repro``: pretrained (run dir or consolidated .pt), dtype, device, batch_size,
max_length (default: the run's trained data.seq_len), max_gen_toks, add_bos.

Offline (no route to huggingface.co), the HF libraries are switched to offline mode up
front, and a task whose dataset is not cached fails in one line naming the task and the
fix: ``python -m mta_repro.eval.lm_eval_tasks TASK test=FILE.jsonl --out DIR`` writes a
task YAML over a local copy (``--include_path DIR --tasks TASK_local``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mta_repro.cli import honour_ctrl_c

_SUBCOMMANDS = ("run", "ls", "validate")


def _has_flag(argv, flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def build_argv(argv: Sequence[str]) -> list:
    """lm-eval's argv with this wrapper's defaults (``--model``, ``--device``) added."""
    argv = list(argv)
    if argv and argv[0] in ("ls", "validate"):
        return argv
    body = argv[1:] if argv and argv[0] == "run" else argv
    if not _has_flag(body, "--model"):
        body = ["--model", "mta_repro"] + body
    if not _has_flag(body, "--device"):
        body = ["--device", "auto"] + body
    return ["run"] + body


def requested_tasks(argv) -> list:
    """The names given to ``--tasks`` (comma-separated, one flag or several)."""
    out = []
    for i, a in enumerate(argv):
        if a == "--tasks" and i + 1 < len(argv):
            out += argv[i + 1].split(",")
        elif a.startswith("--tasks="):
            out += a.split("=", 1)[1].split(",")
    return [t for t in out if t]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    honour_ctrl_c()
    if not argv or argv[0] in ("-h", "--help") or argv == ["run"]:
        print(__doc__)
        argv = ["run", "--help"]
    else:
        argv = build_argv(argv)
    from mta_repro.eval.hub import hub_errors, offline_if_unreachable

    if argv[0] == "run":
        offline_if_unreachable()  # before the HF libraries read their offline flags
    from lm_eval.__main__ import cli_evaluate

    import mta_repro.eval.lm_eval_model  # noqa: F401  registers "mta_repro" with lm-eval

    sys.argv = ["mta-lm-eval"] + argv
    try:
        with hub_errors(requested_tasks(argv)):
            cli_evaluate()
    except SystemExit as e:  # argparse's --help / usage errors
        return int(e.code or 0) if not isinstance(e.code, str) else (print(e.code, file=sys.stderr) or 2)
    except ValueError as e:  # our model's user errors (bad run dir, device, model_args)
        print(f"mta-lm-eval: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
