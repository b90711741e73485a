"""FSDP2 wrapping details, in one process (1-rank gloo group): RoPE tables stay fp32
under mixed precision; activation checkpointing with dropout recomputes the same masks."""

from __future__ import annotations

import pytest
import torch

from mta_repro.model import build_model
from mta_repro.train.args import DistributedArgs
from mta_repro.train.config import compose, model_args_from
from mta_repro.train.distributed import destroy_distributed, init_distributed, materialize, mp_policy, parallelize


@pytest.fixture
def info():
    info = init_distributed(DistributedArgs(), "cpu")
    yield info
    destroy_distributed()


def _shard(model, info, policy):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


@pytest.mark.parametrize("fixed", [True, False])
def test_rope_tables_stay_fp32_under_bf16_mixed_precision(info, fixed):
    """The GPU policy (bf16 parameters), applied here on CPU: the blocks see fp32 cos/sin.
    ``fixed=False`` is FSDP's default policy (cast_forward_inputs=True): bf16 tables."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    args = model_args_from(compose(["data.seq_len=32"]))
    model = build_model(args, device="meta")
    policy = mp_policy(DistributedArgs(), "cuda") if fixed else MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert mp_policy(DistributedArgs(), "cpu") is None  # CPU trains in fp32
    _shard(model, info, policy)
    materialize(model, info, model_args=args)
    seen = {}

    def hook(mod, a):
        x, cos, sin = a[0], a[1], a[2]
        seen.setdefault("x", x.dtype)
        seen.setdefault("cos", cos.dtype)
        seen.setdefault("sin", sin.dtype)

    model.layers[0].register_forward_pre_hook(hook)
    with torch.no_grad():
        out = model(torch.randint(0, args.vocab_size, (1, 16)))
    assert seen["x"] == torch.bfloat16 and out.dtype == torch.bfloat16  # mixed precision is on
    want = torch.float32 if fixed else torch.bfloat16
    assert seen["cos"] == want and seen["sin"] == want


def _grads(info, ac: bool, dropout: float):
    args = model_args_from(compose([f"model.dropout={dropout}"]))
    model = build_model(args, device="meta")
    parallelize(model, info, DistributedArgs(activation_checkpointing=ac))
    materialize(model, info, model_args=args)
    model.train()
    torch.manual_seed(123)
    x = torch.randint(0, args.vocab_size, (2, 32))
    model(x).float().logsumexp(-1).mean().backward()
    return {
        n.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor().clone() for n, p in model.named_parameters()
    }


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_activation_checkpointing_keeps_gradients_with_dropout(info, dropout):
    plain, ac = _grads(info, False, dropout), _grads(info, True, dropout)
    assert plain.keys() == ac.keys()
    for n in plain:
        assert torch.allclose(plain[n], ac[n], atol=1e-6, rtol=1e-5), n


def test_the_forward_keeps_clear_of_the_fsdp_registered_output_head(info):
    """``logits`` is an FSDP forward method (eval calls it alone, in chunks). Called from
    inside the root's forward, its post-forward reshards the root's parameters before
    backward: under torch 2.11 backward then read the final norm's
    freed weight (a segfault on CPU). The forward uses the unregistered head; the
    registered one still gives the same logits, and the gradients equal an unsharded
    model's."""
    args = model_args_from(compose([]))
    model = build_model(args, device="meta")
    parallelize(model, info, DistributedArgs())
    materialize(model, info, model_args=args)
    calls = []
    registered = model.logits
    model.logits = lambda h: (calls.append(h.shape), registered(h))[1]
    x = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(x)
    out.float().logsumexp(-1).mean().backward()
    assert calls == []  # the training forward never entered the registered method
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    plain = build_model(args, device="cpu")
    plain(x).float().logsumexp(-1).mean().backward()
    for n, q in plain.named_parameters():
        torch.testing.assert_close(grads[n], q.grad, rtol=1e-5, atol=1e-7, msg=n)
    with torch.no_grad():
        h = model(x, return_hidden=True)
        torch.testing.assert_close(model.logits(h), out.detach(), rtol=0, atol=0)
