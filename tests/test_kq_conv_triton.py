"""The Triton key-query convolution (the CUDA route of ``blocked``) against ``F.conv2d``
in float64, in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1): forward,
input gradient and kernel gradient, causal diagonal, every pad_key, rows and keys spanning
many tiles, and through the whole blocked path with padding and a cache offset."""

import dataclasses
import importlib.util

import pytest
import torch

from mta_repro.kernels.tuning import KernelTuning
from mta_repro.model import attention_ops

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
    pytest.mark.triton,
]


@pytest.fixture
def small_tiles():
    # 16 x 16 tiles (model.kernels.kq_tile): the shapes below cross many tile borders and the
    # key halo of a 6x11 kernel (10 keys) is most of a tile.
    return KernelTuning(kq_tile="16x16").kq_tile_shape


def reference(x, w, pad_key, diag):
    """F.conv2d of x masked above the diagonal, masked again: the kernel's contract."""
    r, k = x.shape[-2:]
    allowed = (torch.arange(k)[None, :] <= torch.arange(r)[:, None] + diag).to(x.dtype)
    return attention_ops.kq_conv_dense(x * allowed, w[:, None], pad_key) * allowed


def check(shape, cq, ck, pad_key, diag, tile, dtype=torch.float64, tol=1e-12):
    from mta_repro.kernels import kq_conv_triton

    g = torch.Generator().manual_seed(cq * 100 + ck)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    w = torch.randn(shape[1], cq, ck, generator=g, dtype=torch.float64)
    gy = torch.randn(*shape, generator=g, dtype=torch.float64)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = reference(xr, wr, pad_key, min(diag, 10**9))
    want_gx, want_gw = torch.autograd.grad(want, (xr, wr), gy)
    xt, wt = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    got = kq_conv_triton.kq_conv(xt, wt, attention_ops.pad_left(pad_key, ck), diag, *tile)
    got_gx, got_gw = torch.autograd.grad(got, (xt, wt), gy.to(dtype))
    scale = want.abs().max().item()
    for name, a, b in (("y", got, want), ("gx", got_gx, want_gx), ("gw", got_gw, want_gw)):
        err = (a.double() - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
        assert err <= tol, f"{name}: relative max error {err:.3g} > {tol} ({dtype}, {pad_key}, diag {diag})"
    assert scale > 0


@pytest.mark.parametrize("pad_key", ["both", "left", "right"])
@pytest.mark.parametrize("diag", [0, 7, 2**62])  # causal from row 0, a cache offset, no mask
def test_matches_conv2d_float64(small_tiles, pad_key, diag):
    # two batch rows (the kernel gradient sums over them) of two heads (each its own kernel):
    # the programs' planes are batch * H + head
    check((2, 2, 37, 53), 3, 5, pad_key, diag, small_tiles)


def test_release_kernel_wide_rows(small_tiles):
    """The 880M kernel (6 x 11) on rows and keys of several tiles, keys wider than rows."""
    check((1, 2, 40, 90), 6, 11, "both", 0, small_tiles)


def test_float32_and_half_accumulate_in_float32(small_tiles):
    check((1, 2, 33, 33), 6, 11, "both", 0, small_tiles, dtype=torch.float32, tol=1e-5)
    # Half inputs, fp32 accumulation: the rounding of inputs and outputs only (2^-11
    # relative each), not a half-precision sum over the 66 taps or over rows x keys.
    # fp16, not bf16: Triton 3.9's interpreter returns garbage for bf16 dots (numpy has no
    # bf16); scripts/gpu_acceptance.py checks bf16 on the device.
    check((1, 2, 33, 33), 6, 11, "both", 0, small_tiles, dtype=torch.float16, tol=3e-3)


@pytest.mark.parametrize("case", ["plain", "padded", "offset"])
def test_blocked_path_through_triton_matches_reference(case):
    """The whole blocked path with model.kernels.kq_conv=triton (what CUDA runs) against the
    reference implementation: outputs and every gradient, float64; 16x16 tiles, so the
    tuning's tile reaches the kernel through the params."""
    import test_attn_impls as t

    tuning = KernelTuning(kq_conv="triton", kq_tile="16x16")
    q, k, v = t.qkv(b=3, tq=9, tk=9)
    mask = attention_ops.AttnMask()
    if case == "padded":
        kv = torch.ones(3, 9, dtype=torch.bool)
        kv[1, :3] = False
        kv[2, :8] = False
        mask = attention_ops.AttnMask(0, kv)
    elif case == "offset":
        q = q[:, :, :5]
        _, k, v = t.qkv(b=3, tk=12, seed=2)
        mask = attention_ops.AttnMask(7)
    assert attention_ops.kq_conv_backend(q, tuning) == "triton"
    p = dataclasses.replace(t.make_params(pre=(3, 3), post=(2, 3), block_size=4), tuning=tuning)
    t.assert_same("blocked", q, k, v, p, mask)


def test_backend_choice():
    x = torch.zeros(1, 1, 2, 2)
    backend = attention_ops.kq_conv_backend
    assert backend(x) in ("c", "conv2d")  # CPU: the C kernel if it compiled
    assert backend(x.to(torch.bfloat16)) == "conv2d"
    assert backend(x, KernelTuning(kq_conv="conv2d")) == "conv2d"
    assert backend(x, KernelTuning(kq_conv="triton")) == "triton"  # CPU tensors: interpreter (conftest)
    # A CUDA tensor (only its device and dtype are read): the Triton kernels by default,
    # not F.conv2d (ATen's native depthwise kernel for bf16); conv2d only when asked.
    from types import SimpleNamespace

    cuda_x = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)
    assert backend(cuda_x) == "triton"
    assert backend(cuda_x, KernelTuning(kq_conv="conv2d")) == "conv2d"
    with pytest.raises(ValueError, match=r"^model\.kernels\.kq_conv: 'cudnn': expected auto, c, triton or conv2d$"):
        KernelTuning(kq_conv="cudnn")


def test_the_tile_comes_from_the_tuning():
    from mta_repro.kernels import kq_conv_triton

    assert kq_conv_triton.tiles() == (64, 64)  # the default: today's tile
    assert kq_conv_triton.tiles(KernelTuning(kq_tile="16x32")) == (16, 32)
    for bad in ("48x64", "8x8", "64"):
        with pytest.raises(ValueError, match=r"^model\.kernels\.kq_tile: "):
            KernelTuning(kq_tile=bad)
