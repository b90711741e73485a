"""Issue #37 item 1, milestone 1: the stored-scores split of a kq-conv layer
(``mta_repro/kernels/stored_split.py``: stats -> C stored, forward from C, backward kernel A
dO -> dC stored, kernel B dC -> dq, dk, dtheta1) against autograd of the float64 reference
("torch"), for the shipped kq-conv options; only the causal tiles are stored (a read of any
other tile is zero, so a match proves nothing else is read)."""

import dataclasses

import pytest
import torch

from mta_repro.kernels import stored_split
from mta_repro.kernels.types import post_mix_matrix
from mta_repro.model import attention_ops
from tests.test_attn_triton import params


def reference(q, k, v, p, mask, gy):
    ts = {"q": q, "k": k, "v": v}
    ts.update({f: getattr(p, f) for f in attention_ops._WEIGHT_FIELDS if getattr(p, f) is not None})
    ts = {n: t.detach().clone().requires_grad_() for n, t in ts.items()}
    p = dataclasses.replace(p, **{n: t for n, t in ts.items() if n not in "qkv"})
    out = attention_ops.explicit_attention_torch(ts["q"], ts["k"], ts["v"], p, mask)
    (out * gy).sum().backward()
    return out.detach(), {n: t.grad for n, t in ts.items()}


def check(b, h, tq, tk, d, p, mask=attention_ops.AttnMask(), tile=(8, 8)):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for t in (tq, tk, tk))
    gy = torch.randn(b, h, tq, d, generator=g, dtype=torch.float64)
    want, want_g = reference(q, k, v, p, mask, gy)
    k1 = None if p.mta_kernel is None else p.mta_kernel[:, 0]
    k2 = None if p.mta_kernel_after_sm is None else p.mta_kernel_after_sm[:, 0]
    w2 = post_mix_matrix(p)
    got, got_g, stores = stored_split.attention(q, k, v, k1, p.wpsm, k2, w2, p.pad_key, mask.q_offset,
                                                mask.key_valid, tile, do=gy)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    names = {"mta_kernel": "k1", "mta_kernel_after_sm": "k2", "wpsm": "w1"}
    for name, gw in want_g.items():
        if name == "head_kernel":  # the block-diagonal matrix's gradient, gathered per group
            c_h = p.head_kernel.shape[1]
            gm = got_g["w2"]
            mine = torch.stack([gm[i * c_h:(i + 1) * c_h, i * c_h:(i + 1) * c_h].t() for i in range(gw.shape[0])])
        elif name == "wposm":
            mine = got_g["w2"]
        else:
            mine = got_g[names.get(name, name)]
            if name in ("mta_kernel", "mta_kernel_after_sm"):
                mine = mine[:, None]
        torch.testing.assert_close(mine, gw, rtol=1e-9, atol=1e-11, msg=name)
    # only the causal tiles are kept: C and dC, tile by tile
    n = stored_split.stored_tiles(tq, tk, mask.q_offset, *tile)
    for s in stores:
        assert len(s.tiles) == n < -(-tq // tile[0]) * -(-tk // tile[1]) or tq <= tile[0]


@pytest.mark.parametrize("pad_key", ["both", "left", "right"])
@pytest.mark.parametrize("post", [None, (3, 3)])
@pytest.mark.parametrize("mix,wpsm", [("head_kernel", True), ("wposm", False), (None, True)])
def test_split_matches_the_reference(pad_key, post, mix, wpsm):
    """Every pad_key, with and without the post-softmax conv, wpsm, head_kernel / wposm:
    output and every gradient equal the float64 reference's; tiles of 8 x 8 over T = 21
    put the convolutions' reads across tile edges and past the diagonal tile."""
    h = 4
    check(2, h, 21, 21, 5, params(h, (3, 5), post, mix, wpsm, pad_key, group=2))


def test_split_with_padding_offset_and_the_880m_kernel_shape():
    """Left padding whose edge falls inside a tile, cached keys (q_offset), and the 880M
    model's 6 x 11 kernels before and after softmax (its `both` padding)."""
    h = 4
    key_valid = torch.ones(2, 29, dtype=torch.bool)
    key_valid[1, :11] = False
    check(2, h, 29, 29, 4, params(h, (6, 11), (6, 11), "head_kernel", True, "both", group=2),
          attention_ops.AttnMask(0, key_valid))
    check(2, h, 13, 29, 4, params(h, (3, 4), (2, 3), "wposm", True, "right", seed=3),
          attention_ops.AttnMask(16, key_valid))


def test_stored_plane_bytes_are_the_causal_tiles():
    """A stored plane of T = 2048 in 128 x 64 tiles: 16 row blocks of 2, 4, ..., 32 key blocks."""
    n = stored_split.stored_tiles(2048, 2048, 0, 128, 64)
    assert n == sum(2 * (t + 1) for t in range(16)) == 272
    assert stored_split.plane_bytes(4, 16, 2048, 128, 64, torch.bfloat16) == 4 * 16 * 272 * 128 * 64 * 2
