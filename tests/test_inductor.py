"""The compiled paths under the real Inductor backend (C++ codegen on the CPU), not only
aot_eager: the blocked path's query block (``model.kernels.compile_block=true``, what CUDA runs by
default) and the trainer's ``distributed.compile=true`` (each block compiled, as
torchtitan does): no graph breaks, the graphs Dynamo makes, the eager values. Inductor's
codegen costs tens of seconds here: the slow tier."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch._dynamo.utils import counters

from mta_repro.kernels.tuning import KernelTuning
from mta_repro.model import attention_ops
from mta_repro.train.config import compose


def _block_run(backend: str, compiled: bool = True):
    """A training step and an evaluation of the blocked path at T=23 (block 4: six blocks,
    the first at key offset 0), float64; (outputs and q/k/v gradients, graph count)."""
    import test_attn_impls as t

    tuning = KernelTuning(compile_block=compiled, compile_block_backend=backend)
    torch._dynamo.reset()
    attention_ops.reset_compiled_blocks()
    counters.clear()
    p = dataclasses.replace(t.make_params(pre=(3, 3), post=(2, 3), block_size=4), tuning=tuning)
    q, k, v = (x.requires_grad_() for x in t.qkv(b=2, tq=23, tk=23))
    out = attention_ops.explicit_attention_blocked(q, k, v, p, attention_ops.AttnMask(), training=True)
    out.backward(torch.ones_like(out))
    with torch.no_grad():
        ev = attention_ops.explicit_attention_blocked(q, k, v, p, attention_ops.AttnMask(), training=False)
    values = [out.detach(), ev, q.grad, k.grad, v.grad]
    return values, counters["stats"]["unique_graphs"], dict(counters["graph_break"])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
def test_the_compiled_block_under_inductor_matches_eager_without_breaks():
    eager, _, _ = _block_run("inductor", compiled=False)
    got, graphs, breaks = _block_run("inductor")
    assert breaks == {}
    # Per mode (training, no-grad evaluation): the blocks at key offsets 0 and 1 (Dynamo
    # specialises 0 and 1) and one symbolic graph for all the others; aot_eager makes the
    # same 6 (tests/test_attention_ops.py bounds them per step).
    assert graphs == 6
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch._dynamo.reset()
    attention_ops.reset_compiled_blocks()


COMMON = [
    "data.seq_len=16",
    "data.batch_size=2",
    "data.shuffle_buffer=4",
    "trainer.steps=2",
    "trainer.device=cpu",
    "trainer.eval_every=0",
    "checkpoint.every=2",
    "checkpoint.export=false",
    "logging.every=1",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
    "attention=mta",
    "model=tiny",
    "model.n_layers=2",
    "model.dim=32",
    "model.n_heads=4",
    "model.mta.mta_layers='1'",
    "distributed.param_dtype=float32",
]


def _losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
def test_distributed_compile_trains_under_inductor_like_eager(tmp_path):
    from mta_repro.train.loop import train

    torch._dynamo.reset()
    counters.clear()
    # the whole block compiled; its attention traced in place
    train(
        compose(
            [
                *COMMON,
                f"run_dir={tmp_path / 'compiled'}",
                "distributed.compile=true",
                "model.kernels.compile_block=false",
            ]
        )
    )
    assert dict(counters["graph_break"]) == {}
    # One graph per block kind (the mixing layer and the kq-conv layer), each compiled once:
    # the second step reuses them.
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()
    train(compose([*COMMON, f"run_dir={tmp_path / 'eager'}"]))
    assert _losses(tmp_path / "compiled") == pytest.approx(_losses(tmp_path / "eager"), rel=1e-5)
