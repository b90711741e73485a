"""The attention math against plain loops over the paper's / release's formulas (float64)."""

import dataclasses
import math

import pytest
import torch

from mta_repro.kernels.tuning import KernelTuning
from mta_repro.model import ModelArgs, attention_ops
from mta_repro.model.transformer import Attention

torch.manual_seed(0)


# ---------------------------------------------------------------- plain references
def loop_kq_conv(S, K, pad_key):
    """out[h,i,j] = sum_{a,b} K[h,a,b] * S[h, i+a-(c_q-1), j+b-p_left], S zero outside."""
    H, T, Tk = S.shape
    _, c_q, c_k = K.shape
    p_left = {"both": (c_k - 1) // 2, "left": c_k - 1, "right": 0}[pad_key]
    out = torch.zeros_like(S)
    for h in range(H):
        for i in range(T):
            for j in range(Tk):
                acc = 0.0
                for a in range(c_q):
                    for b in range(c_k):
                        ii, jj = i + a - (c_q - 1), j + b - p_left
                        if 0 <= ii < T and 0 <= jj < Tk:
                            acc += K[h, a, b].item() * S[h, ii, jj].item()
                out[h, i, j] = acc
    return out


def loop_softmax_rows(S, allowed):
    out = torch.zeros_like(S)
    for h in range(S.shape[0]):
        for i in range(S.shape[1]):
            js = [j for j in range(S.shape[2]) if allowed[i, j]]
            m = max(S[h, i, j].item() for j in js)
            z = sum(math.exp(S[h, i, j].item() - m) for j in js)
            for j in js:
                out[h, i, j] = math.exp(S[h, i, j].item() - m) / z
    return out


def loop_mta_attention(q, k, v, Kpre, Wpsm, Kpost, head_kernel, Wposm, pad_key):
    """One batch element, everything by hand. q, k, v: (H, T, d)."""
    H, T, d = q.shape
    allowed = torch.tensor([[j <= i for j in range(T)] for i in range(T)])
    S = torch.zeros(H, T, T, dtype=torch.float64)
    for h in range(H):
        for i in range(T):
            for j in range(T):
                S[h, i, j] = sum(q[h, i, x].item() * k[h, j, x].item() for x in range(d)) / math.sqrt(d)
    if Kpre is not None:
        S = loop_kq_conv(S * allowed, Kpre, pad_key)
    if Wpsm is not None:
        S = torch.stack([sum(Wpsm[g, h] * S[h] for h in range(H)) for g in range(H)])
    A = loop_softmax_rows(S, allowed)
    if Kpost is not None:
        A = loop_kq_conv(A, Kpost, pad_key) * allowed
    if head_kernel is not None:
        G, c, _ = head_kernel.shape
        A = torch.stack([sum(A[(o // c) * c + i] * head_kernel[o // c, i, o % c] for i in range(c)) for o in range(H)])
    elif Wposm is not None:
        A = torch.stack([sum(Wposm[g, h] * A[h] for h in range(H)) for g in range(H)])
    return torch.einsum("hij,hjd->hid", A, v)


# ----------------------------------------------------------------------- tests
@pytest.mark.parametrize("pad_key", ["both", "left", "right"])
def test_kq_conv_equals_formula(pad_key):
    H, T, c_q, c_k = 2, 6, 3, 5 if pad_key == "both" else 4
    S = torch.randn(1, H, T, T, dtype=torch.float64)
    K = torch.randn(H, 1, c_q, c_k, dtype=torch.float64)
    got = attention_ops.kq_conv_dense(S, K, pad_key)[0]
    torch.testing.assert_close(got, loop_kq_conv(S[0], K[:, 0], pad_key), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pad_key", ["both", "left", "right"])
def test_identity_kernel_is_identity(pad_key):
    S = torch.randn(1, 3, 5, 5, dtype=torch.float64)
    K = attention_ops.identity_kq_kernel(3, 4, 5, pad_key).double()
    torch.testing.assert_close(attention_ops.kq_conv_dense(S, K, pad_key), S, rtol=0, atol=0)


@pytest.mark.parametrize(
    "pad_key, pre, post, mix",
    [
        ("both", True, True, "head_kernel"),
        ("left", True, False, "wposm"),
        ("right", False, True, None),
        ("both", True, False, "head_kernel"),
    ],
)
def test_explicit_attention_equals_formula(pad_key, pre, post, mix):
    """Pre- and post-softmax convolutions, head mixing, masking: the whole score path."""
    H, T, d = 4, 6, 3
    q, k, v = (torch.randn(1, H, T, d, dtype=torch.float64) for _ in range(3))
    ck = 3 if pad_key == "both" else 2
    Kpre = torch.randn(H, 1, 2, ck, dtype=torch.float64) if pre else None
    Kpost = torch.randn(H, 1, 3, ck, dtype=torch.float64) if post else None
    Wpsm = torch.randn(H, H, dtype=torch.float64)
    hk = torch.randn(2, 2, 2, dtype=torch.float64) if mix == "head_kernel" else None
    Wposm = torch.randn(H, H, dtype=torch.float64) if mix == "wposm" else None
    params = attention_ops.ExplicitAttnParams(
        mta_kernel=Kpre, wpsm=Wpsm, mta_kernel_after_sm=Kpost, head_kernel=hk, wposm=Wposm, pad_key=pad_key
    )
    got = attention_ops.explicit_attention_torch(q, k, v, params, attention_ops.AttnMask())[0]
    want = loop_mta_attention(
        q[0],
        k[0],
        v[0],
        None if Kpre is None else Kpre[:, 0],
        Wpsm,
        None if Kpost is None else Kpost[:, 0],
        hk,
        Wposm,
        pad_key,
    )
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_head_mixing_conventions():
    """wpsm/wposm are output-major (nn.Linear), head_kernel is input-major."""
    x = torch.randn(1, 4, 3, 3, dtype=torch.float64)
    W = torch.zeros(4, 4, dtype=torch.float64)
    W[0, 1] = 1.0  # output head 0 <- input head 1
    out = attention_ops.head_mix_linear(x, W)
    torch.testing.assert_close(out[0, 0], x[0, 1])
    assert out[0, 1:].abs().max() == 0
    K = torch.zeros(2, 2, 2, dtype=torch.float64)
    K[1, 1, 0] = 1.0  # group 1: input head 3 (= 2+1) -> output head 2 (= 2+0)
    out = attention_ops.head_conv(x, K)
    torch.testing.assert_close(out[0, 2], x[0, 3])
    assert out[0, [0, 1, 3]].abs().max() == 0


def _rope_complex(x, pos, theta):
    """Independent RoPE: pairs (2i, 2i+1) as complex numbers times e^{i p theta^(-2i/d)}."""
    d = x.shape[-1]
    z = torch.complex(x[..., 0::2], x[..., 1::2])
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(len(pos), d // 2, dtype=torch.float64), pos[:, None].double() * freqs)
    z = z * rot[:, None, :]
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)


def test_diff_attention_equals_two_softmax_formula():
    args = ModelArgs(dim=32, n_layers=3, n_heads=4, vocab_size=11, diff_transformer=True, rope_theta=1e4)
    layer_id, T = 2, 7
    attn = Attention(args, layer_id).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(1, T, 32, dtype=torch.float64)
    from mta_repro.model.transformer import rope_cos_sin

    cos, sin = rope_cos_sin(8, torch.arange(T), 1e4, torch.float64)
    got = attn(x, cos, sin)[0]

    d, Hp = 8, 2  # head_dim, diff heads
    pos = torch.arange(T)
    q = _rope_complex((x[0] @ attn.wq.weight.T).view(T, 4, d), pos, 1e4)
    k = _rope_complex((x[0] @ attn.wk.weight.T).view(T, 4, d), pos, 1e4)
    v = x[0] @ attn.wv.weight.T  # (T, 32): diff head i owns columns [16 i, 16 i + 16)
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * layer_id)
    lam = (
        math.exp((attn.lambda_q1 * attn.lambda_k1).sum().item())
        - math.exp((attn.lambda_q2 * attn.lambda_k2).sum().item())
        + lam_init
    )
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    heads = []
    for i in range(Hp):
        A = []
        for c in range(2):
            s = q[:, 2 * i + c] @ k[:, 2 * i + c].T / math.sqrt(d)
            A.append(torch.softmax(s.masked_fill(~causal, float("-inf")), -1))
        h = (A[0] - lam * A[1]) @ v[:, 2 * d * i : 2 * d * (i + 1)]
        h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.subln.weight
        heads.append(h * (1 - lam_init))
    want = torch.cat(heads, -1) @ attn.wo.weight.T
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_group_norm_and_gate_formula():
    """Group norm (per head, shared weight, depth-scaled) then the 1-d sigmoid gate."""
    from mta_repro.model import MTAArgs

    args = ModelArgs(
        dim=16,
        n_layers=3,
        n_heads=2,
        vocab_size=11,
        mta=MTAArgs(use_mta=True, pre_sm_linear_head=True, group_norm=True, layer_norm_rescale=True, add_gating=True),
    )
    attn = Attention(args, layer_id=2).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    T = 5
    x = torch.randn(1, T, 16, dtype=torch.float64)
    from mta_repro.model.transformer import rope_cos_sin

    cos, sin = rope_cos_sin(8, torch.arange(T), args.rope_theta, torch.float64)
    got = attn(x, cos, sin)[0]
    pos = torch.arange(T)
    q = _rope_complex((x[0] @ attn.wq.weight.T).view(T, 2, 8), pos, args.rope_theta).transpose(0, 1)
    k = _rope_complex((x[0] @ attn.wk.weight.T).view(T, 2, 8), pos, args.rope_theta).transpose(0, 1)
    v = (x[0] @ attn.wv.weight.T).view(T, 2, 8).transpose(0, 1)
    o = loop_mta_attention(q, k, v, None, attn.wpsm.weight.detach(), None, None, None, "both")
    o = o.transpose(0, 1)  # (T, H, d)
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.subln.weight
    o = o * (1 - (0.8 - 0.6 * math.exp(-0.3 * 2)))
    o = o * torch.sigmoid(o @ attn.gate.weight.T + attn.gate.bias)
    want = o.reshape(T, 16) @ attn.wo.weight.T
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-10)


def test_curse_norm_scales_both_block_norms_by_depth():
    """The release's curse_norm: block norm outputs times 1 - (0.8 - 0.6 exp(-0.3 l))."""
    from mta_repro.model import MTAArgs
    from mta_repro.model.transformer import TransformerBlock

    x = torch.randn(2, 5, 16, dtype=torch.float64)
    for layer_id in (0, 3):
        args = ModelArgs(dim=16, n_layers=4, n_heads=2, vocab_size=11, mta=MTAArgs(curse_norm=True))
        block = TransformerBlock(args, layer_id).double()
        plain = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        scale = 1 - (0.8 - 0.6 * math.exp(-0.3 * layer_id))
        torch.testing.assert_close(block.attention_norm(x), plain * scale)
        torch.testing.assert_close(block.ffn_norm(x), plain * scale)


# ------------------------------------------------------- blocked: block size, compiled block
def test_block_size_default_is_per_device():
    assert attention_ops.resolve_block_size(None, torch.device("cpu")) == 128
    assert attention_ops.resolve_block_size(None, "cuda") == attention_ops.DEFAULT_BLOCK_SIZE["cuda"] == 512
    assert attention_ops.resolve_block_size(64, "cuda") == 64  # a configured size wins
    assert ModelArgs().attn_block_size is None


def test_compiled_block_no_graph_breaks_and_bounded_recompiles():
    """The query block under torch.compile (what CUDA runs by default): no graph break, the
    eager result, and a bounded number of graphs: with dynamic shapes a block at key
    offset 0 or 1 gets its own graph (Dynamo specialises 0 and 1), training and no-grad
    each get theirs, and a new length adds at most one; a third length adds none.
    (aot_eager: Dynamo's graphs without Inductor's codegen, which costs minutes here.)"""
    import test_attn_impls as t
    from torch._dynamo.utils import counters

    tuning = KernelTuning(compile_block=True, compile_block_backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    p = dataclasses.replace(t.make_params(pre=(3, 3), post=(2, 3), block_size=4), tuning=tuning)

    def run(T, grad):  # a training step (forward, recomputing backward) or an evaluation
        q, k, v = (x.requires_grad_(grad) for x in t.qkv(b=2, tq=T, tk=T))
        with torch.set_grad_enabled(grad):
            out = attention_ops.explicit_attention_blocked(q, k, v, p, attention_ops.AttnMask(), training=grad)
            if grad:
                out.backward(torch.ones_like(out))

    graphs = []
    for T, grad in [(11, True), (11, False), (17, True), (23, True)]:
        run(T, grad)
        graphs.append(counters["stats"]["unique_graphs"])
    assert dict(counters["graph_break"]) == {}
    assert graphs[0] <= 3 and graphs[1] <= graphs[0] + 2 and graphs[2] <= graphs[1] + 1 and graphs[3] == graphs[2]

    def grads(compiled):  # outputs and q/k/v gradients through the recomputed blocks
        q, k, v = (x.requires_grad_() for x in t.qkv(b=2, tq=23, tk=23))
        pc = dataclasses.replace(p, tuning=dataclasses.replace(tuning, compile_block=compiled))
        out = attention_ops.explicit_attention_blocked(q, k, v, pc, attention_ops.AttnMask(), training=True)
        out.backward(torch.ones_like(out))
        return [out, q.grad, k.grad, v.grad]

    for a, b in zip(grads(True), grads(False)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert counters["stats"]["unique_graphs"] == graphs[3]  # same length again: no recompile
    torch._dynamo.reset()


def test_attention_ops_is_the_three_modules_under_one_name():
    """The facade defines nothing: every name it offers is the very object of the module that
    does that job (the math, the blocked engine, the registry), so a caller of either sees one
    registry and one function."""
    from mta_repro.kernels import interface
    from mta_repro.model import attention_blocked, attention_math, attention_registry

    homes = (attention_math, attention_blocked, attention_registry, interface)
    for name in attention_ops.__all__:
        assert any(getattr(m, name, None) is getattr(attention_ops, name) for m in homes), name
    assert attention_ops.ATTN_IMPLS is attention_registry.ATTN_IMPLS
    assert attention_ops.explicit_attention_torch.__module__ == "mta_repro.model.attention_math"
    assert attention_ops.explicit_attention_blocked.__module__ == "mta_repro.model.attention_blocked"
    assert attention_ops.attn_impl.__module__ == "mta_repro.model.attention_registry"
