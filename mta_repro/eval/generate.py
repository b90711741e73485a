"""Generate text from a trained run with the KV-cache generator.

    python -m mta_repro.eval.generate runs/880m_mta --prompt "The capital of France is"
    python -m mta_repro.eval.generate runs/x/export/consolidated.pt --prompt "a" --prompt "b" \\
        --max-new-tokens 64 --temperature 0.8 --top-p 0.95 --seed 0

Loads the newest complete weights of a run directory (or a consolidated ``.pt``) and
the run's tokenizer, encodes each prompt with BOS (as in training), and prints each
continuation (greedy unless --temperature > 0), one block per prompt. Prompts are
left-truncated to fit --max-length (default: the run's trained data.seq_len) together
with the new tokens. Generation stops at EOS or at any --stop string.

stderr names the weights loaded (the export or checkpoint, and its step) and the
tokenizer. A continuation that is only whitespace (what a barely trained model emits) is
summarised on stderr, e.g. ``64 x '\n'``, instead of printing blank lines; ``--raw``
prints every continuation exactly as generated.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from mta_repro.errors import UserError

log = logging.getLogger("mta_repro.eval.generate")  # not __main__ under python -m


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m mta_repro.eval.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("path", help="run directory or consolidated .pt file")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--max-length", type=int, default=None, help="prompt + new tokens (default: trained seq_len)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    ap.add_argument("--no-bos", action="store_true", help="do not start prompts with BOS")
    ap.add_argument("--raw", action="store_true", help="print whitespace-only continuations as they are")
    return ap


def generate_from(
    path,
    prompts,
    max_new_tokens=64,
    temperature=0.0,
    top_k=None,
    top_p=None,
    seed=0,
    stop=(),
    max_length=None,
    device="auto",
    dtype="float32",
    add_bos=True,
    report=None,
) -> list:
    """Continuations of ``prompts`` by the model at ``path`` (run dir or .pt). ``report``
    (a callable) receives one line naming the weights and tokenizer loaded."""
    import torch

    from mta_repro.eval.load import load_for_eval
    from mta_repro.model.generation import generate_text
    from mta_repro.train.config import trained_seq_len

    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens: expected a positive count, got {max_new_tokens}")
    if temperature < 0:
        raise UserError(f"--temperature: expected >= 0, got {temperature}")
    model, tok, cfg = load_for_eval(path, device=device, dtype=dtype)
    max_length = max_length or trained_seq_len(cfg) or model.args.max_seqlen
    if report is not None:
        report(loaded_line(model, cfg, max_new_tokens, temperature))
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    return generate_text(
        model,
        tok,
        list(prompts),
        max_new_tokens,
        until=list(stop),
        max_length=max_length,
        add_bos=add_bos,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=gen,
    )


def loaded_line(model, cfg, max_new_tokens: int, temperature: float) -> str:
    src = getattr(model, "source", {})
    step = f" (step {src['step']})" if src.get("step") is not None else ""
    t = cfg.get("data", {}).get("tokenizer", {})
    name = t.get("name", "sentencepiece")
    tok = name if name == "bytes" else f"{name} {t.get('path')}"  # bytes needs no file
    how = "greedy" if temperature == 0 else f"sampling at temperature {temperature:g}"
    return f"generate: weights {src.get('path')}{step}, tokenizer {tok}; {how}, up to {max_new_tokens} new tokens"


def whitespace_summary(text: str) -> str:
    """``64 x '\\n'`` for a run of one character, else the repr of a short text."""
    if len(set(text)) == 1:
        return f"{len(text)} x {text[0]!r}"
    return repr(text) if len(text) <= 40 else f"{len(text)} whitespace characters ({text[:20]!r}...)"


def main(argv: Sequence[str] | None = None) -> int:
    from mta_repro.cli import run_cli

    args = parser().parse_args(argv)

    def go() -> int:
        outs = generate_from(
            args.path,
            args.prompt,
            args.max_new_tokens,
            args.temperature,
            args.top_k,
            args.top_p,
            args.seed,
            args.stop,
            args.max_length,
            args.device,
            args.dtype,
            not args.no_bos,
            report=log.info,
        )
        for i, (prompt, out) in enumerate(zip(args.prompt, outs)):
            if len(outs) > 1:
                print(f"=== prompt {i}")
            if out and not out.strip() and not args.raw:
                print(prompt)
                log.warning(
                    f"generate: prompt {i}: the continuation is whitespace only ({whitespace_summary(out)}); "
                    "--raw prints it"
                )
            else:
                print(prompt + out)
        return 0

    return run_cli("generate", go)


if __name__ == "__main__":
    sys.exit(main())
