"""trainer.loss_chunk (mta_repro/model/loss.py): the chunked cross entropy equals the plain
loss (float64: the loss and the gradients w.r.t. the hidden states, the output weight and
every parameter of a model, tied or not), and saves no (N, V) tensor for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mta_repro.model import ModelArgs, build_model
from mta_repro.model.loss import chunked_linear_cross_entropy, cross_entropy


def _plain(h, w, t):
    return F.cross_entropy(F.linear(h, w), t)  # float64 throughout: the reference


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_equals_the_plain_loss_and_its_gradients_in_float64(chunk):
    g = torch.Generator().manual_seed(0)
    n, d, v = 37, 16, 50
    h = torch.randn(n, d, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(v, d, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    t[[3, 20]] = -100  # ignored rows, as F.cross_entropy's default ignore_index
    want = _plain(h, w, t)
    want_h, want_w = torch.autograd.grad(want * 3.0, (h, w))
    got = chunked_linear_cross_entropy(h, w, t, chunk)
    got_h, got_w = torch.autograd.grad(got * 3.0, (h, w))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_h, want_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_w, want_w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_models_loss_and_every_gradient_match_the_plain_loss(tied):
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, weight_tying=tied)
    torch.manual_seed(0)
    model = build_model(args, device="cpu").double()
    x = torch.randint(0, 64, (2, 24))
    y = torch.randint(0, 64, (2, 24))
    plain = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # float64 (the trainer's casts to fp32)
    want = torch.autograd.grad(plain, list(model.parameters()))
    chunked = cross_entropy(model, x, y, chunk_rows=10)
    got = torch.autograd.grad(chunked, list(model.parameters()))
    torch.testing.assert_close(chunked, plain, rtol=1e-12, atol=1e-12)
    for (name, _), a, b in zip(model.named_parameters(), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def _saved_bytes(fn) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_backward_saves_no_logits():
    """Measured with saved_tensors_hooks: the plain loss saves the fp32 (N, V) log-softmax
    (and the compute-dtype logits where they are not fp32); the chunked loss saves h, the
    weight, the targets and one log-sum-exp per row."""
    n, d, v = 512, 64, 4096
    h = torch.randn(n, d, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(v, d, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, v, (n,))
    plain = _saved_bytes(lambda: F.cross_entropy(F.linear(h, w).float(), t))
    chunked = _saved_bytes(lambda: chunked_linear_cross_entropy(h, w, t, 128))
    assert plain >= n * v * 4  # the fp32 log-softmax
    inputs = h.nbytes + w.nbytes + t.nbytes
    assert chunked <= inputs + n * 4 + 64  # + the log-sum-exp per row and the row count
    # and in bf16 the loss is the plain one up to fp32 summation order
    torch.testing.assert_close(
        chunked_linear_cross_entropy(h, w, t, 128), F.cross_entropy(F.linear(h, w).float(), t), rtol=1e-5, atol=1e-5
    )


@pytest.mark.slow
def test_the_trainer_trains_the_same_with_a_chunked_loss(tmp_path):
    """Through the trainer's FSDP2 wrapping (one CPU rank): three steps with
    trainer.loss_chunk=64 log the plain loss's losses and gradient norms (fp32 rounding)."""
    import json

    from mta_repro.train.config import compose
    from mta_repro.train.loop import train

    base = ["experiment=debug", "trainer.steps=3", "trainer.eval_every=0", "logging.every=1"]
    base += ["logging.wandb_mode=disabled", "logging.progress_bar=false", "trainer.device=cpu"]
    logged = {}
    for chunk in (0, 64):
        run_dir = tmp_path / f"chunk{chunk}"
        train(compose([*base, f"trainer.loss_chunk={chunk}", f"run_dir={run_dir}"]))
        rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
        logged[chunk] = [(r["loss"], r["grad_norm"]) for r in rows if "grad_norm" in r]
    assert len(logged[0]) == 3
    for (a, ga), (b, gb) in zip(logged[0], logged[64], strict=True):
        assert b == pytest.approx(a, rel=1e-5) and gb == pytest.approx(ga, rel=1e-4)


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_a_bad_loss_chunk_is_one_line(bad):
    from mta_repro.errors import UserError
    from mta_repro.train.args import TrainerArgs

    with pytest.raises(UserError, match=r"^trainer.loss_chunk: expected an integer >= 0"):
        TrainerArgs(loss_chunk=bad)
