"""The op beside Liger-Kernel's ``LigerMultiTokenAttention`` (the dev extra installs it; on CPU
its Triton kernels run in Triton's interpreter, tests/conftest.py sets TRITON_INTERPRET=1).

Liger takes a score matrix and computes mask, softmax, ``F.conv2d`` with symmetric padding,
mask: the release's post-softmax convolution where the query kernel is one row (c_q = 1),
which is where the two must agree. With c_q > 1 its symmetric padding reads later query
rows, where the release (and this op) read only earlier ones: that difference is asserted
as what it is, the op staying causal."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (pip install liger-kernel; in the dev extra)")

from liger_kernel.transformers.multi_token_attention import LigerMultiTokenAttention

from mta_repro.mta import multi_token_attention

pytestmark = pytest.mark.triton

H, T, D = 4, 16, 8


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, T, D, generator=g).requires_grad_() for _ in range(3)]


def liger_attention(layer, q, k, v):
    """Liger's part (probabilities from scores) inside attention: (softmax-conv of q k^T) v."""
    return layer(q @ k.transpose(-1, -2) * D**-0.5) @ v


@pytest.mark.parametrize("c_k", [3, 5])
def test_the_post_softmax_convolution_equals_liger_where_liger_covers_it(c_k):
    """c_q = 1, a centred key window (pad_key both): outputs and the gradients of q, k, v and
    the kernel equal Liger's (float32), and both equal the float64 op."""
    layer = LigerMultiTokenAttention(H, H, kernel_size=(1, c_k), padding=(0, c_k // 2), groups=H, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(H, 1, 1, c_k, generator=torch.Generator().manual_seed(1)))
    q, k, v = _inputs()
    kernel = layer.weight.detach().clone().requires_grad_()
    theirs = liger_attention(layer, q, k, v)
    ours = multi_token_attention(*(x.detach().requires_grad_() for x in (q, k, v)), kq_kernel_after_softmax=kernel)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    gy = torch.randn_like(ours)
    ga = torch.autograd.grad(theirs, [q, k, v, layer.weight], gy)
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    out = multi_token_attention(qq, kk, vv, kq_kernel_after_softmax=kernel)
    gb = torch.autograd.grad(out, [qq, kk, vv, kernel], gy)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    q64, k64, v64 = (x.detach().double() for x in (q, k, v))
    want = multi_token_attention(q64, k64, v64, kq_kernel_after_softmax=kernel.detach().double())
    assert (theirs.double() - want).abs().max() < 1e-5


def test_liger_with_query_rows_reads_later_queries_and_the_op_does_not():
    """c_q = 3: Liger can only pad the query axis symmetrically (one row before, one after),
    so row i mixes the probabilities of query i + 1; the op (the release's past-only
    padding) does not: changing the last query changes only the op's last row."""
    layer = LigerMultiTokenAttention(H, H, kernel_size=(3, 3), padding=(1, 1), groups=H, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(H, 1, 3, 3, generator=torch.Generator().manual_seed(2)))
    q, k, v = (x.detach() for x in _inputs())
    q2 = q.clone()
    q2[:, :, -1] += 1.0
    with torch.no_grad():
        liger_rows = (liger_attention(layer, q2, k, v) - liger_attention(layer, q, k, v)).abs().amax((0, 1, 3))
        ours = [multi_token_attention(x, k, v, kq_kernel_after_softmax=layer.weight) for x in (q, q2)]
    ours_rows = (ours[1] - ours[0]).abs().amax((0, 1, 3))
    assert liger_rows[-2] > 1e-3  # Liger's row T-2 read query T-1
    assert ours_rows[:-1].max() == 0 and ours_rows[-1] > 1e-3
