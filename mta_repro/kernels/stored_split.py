"""Issue #37 item 1, milestone 1: the *stored-scores* split of a kq-conv layer, as a torch
prototype (any dtype; the tests run it in float64 against autograd of the reference).

The fused kernel (``attention_triton.py``) recomputes the convolved scores C in each of its
four passes, as a factorised product of inner dimension c_q * d plus a band correction.
The stored design computes C once and keeps it:

- ``stats``: S0 = q k^T * scale on the allowed cells (zero elsewhere: *mask, then conv*),
  C = conv_theta1(S0) (the key-query convolution: banded Toeplitz products, one per row
  shift, ``toeplitz_conv``), **C stored** (the causal tiles only, ``TileStore``; in the
  model's dtype: bf16 rounds C where the reference's bf16 path does), Z = W1 C (pre-softmax
  head mixing), the rows' log-sum-exp.
- ``forward``: C read back, Z, P = exp(Z - lse) on the allowed cells, R = conv_theta2(P)
  (post-softmax convolution, masked), A = W2 R (post-softmax head mixing), O = A v.
- backward **kernel A** (dO -> dC; two launches, as D needs the whole row first):
  ``backward_rowsum`` (dA = dO v^T, dR = W2^T dA masked, dP = conv_theta2^T(dR) masked,
  D = rowsum(P * dP)) and ``backward_dc`` (dZ = P (dP - D), **dC = W1^T dZ stored**,
  dW1 = sum dZ C^T over cells, dW2 = sum dA R^T, dtheta2, dv = A^T dO).
- backward **kernel B** (dC -> dq, dk, dtheta1): S0 recomputed (a plain product, no halo:
  the cells it reads are its own tile's), dS0 = conv_theta1^T(dC) on the allowed cells (dC
  read on the tile and the c_q - 1 rows below / c_k - 1 columns beside it, all stored, zero
  beyond the causal tiles), dq = dS0 k * scale, dk = dS0^T q * scale, dtheta1 = the
  correlation of S0 with dC (the transposed Toeplitz product's diagonals).

Kernel B carries no head mixing, softmax or post-softmax convolution (no halo of its own
beyond the dC window it reads from the store, and only a per-head working set); kernel A
carries no score GEMM of inner dimension c_q * d and no band correction.

Which cells are stored: C is read only where a cell is allowed (Z elsewhere is -inf; the
post-softmax convolution reads P, which is zero outside them), dC is zero outside them, so
the tiles holding an allowed cell suffice (``TileStore``: a read of any other tile is zero,
so a test against the reference proves nothing else is read). Dropout is not prototyped
(the reference draws it with ``F.dropout``; the fused kernel's masks are its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mta_repro.kernels.conv_pad import pad_left


# ----------------------------------------------------------------- storage
class TileStore:
    """(B, H, Tq, Tk) planes kept as the (bm x bn) tiles that hold an allowed cell: row block t
    keeps key blocks up to the one holding its last query (``q_off`` shifts the diagonal).
    ``write`` drops every other tile; ``read`` returns them as zero."""

    def __init__(self, b: int, h: int, tq: int, tk: int, q_off: int, bm: int, bn: int, dtype: torch.dtype):
        self.shape, self.q_off, self.bm, self.bn, self.dtype = (b, h, tq, tk), q_off, bm, bn, dtype
        self.tiles: dict = {}

    def kept(self):
        b, h, tq, tk = self.shape
        for t in range(-(-tq // self.bm)):
            last = min(tq, (t + 1) * self.bm) - 1 + self.q_off
            for c in range(min(-(-tk // self.bn), last // self.bn + 1)):
                yield t, c

    def write(self, x: torch.Tensor) -> None:
        self.tiles = {(t, c): x[:, :, t * self.bm:(t + 1) * self.bm, c * self.bn:(c + 1) * self.bn].to(self.dtype)
                      for t, c in self.kept()}

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(self.shape, dtype=dtype)
        for (t, c), x in self.tiles.items():
            out[:, :, t * self.bm:t * self.bm + x.shape[2], c * self.bn:c * self.bn + x.shape[3]] = x.to(dtype)
        return out

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.tiles.values())


def stored_tiles(tq: int, tk: int, q_off: int, bm: int, bn: int) -> int:
    """Tiles of one (batch, head) plane that a ``TileStore`` keeps."""
    n = 0
    for t in range(-(-tq // bm)):
        last = min(tq, (t + 1) * bm) - 1 + q_off
        n += min(-(-tk // bn), last // bn + 1)
    return n


# ----------------------------------------------------------------- pieces
def allowed(tq: int, tk: int, q_off: int, key_valid: Optional[torch.Tensor]) -> torch.Tensor:
    """(1 or B, 1, Tq, Tk) bool: causal from q_off, minus padding (``types.allowed_mask``)."""
    i = torch.arange(tq)[:, None] + q_off
    j = torch.arange(tk)[None, :]
    m = (j <= i)[None, None]
    if key_valid is not None:
        m = m & key_valid[:, None, None, :] & key_valid[:, q_off:q_off + tq][:, None, :, None]
    return m


def shift_rows(x: torch.Tensor, s: int) -> torch.Tensor:
    """y[..., i, :] = x[..., i + s, :], zero outside."""
    t = x.shape[-2]
    y = torch.zeros_like(x)
    if abs(s) < t:
        if s >= 0:
            y[..., :t - s, :] = x[..., s:, :]
        else:
            y[..., -s:, :] = x[..., :t + s, :]
    return y


def toeplitz(theta_row: torch.Tensor, tk: int, pl: int) -> torch.Tensor:
    """(H, Tk, Tk) banded Toeplitz matrices of one kernel row (H, c_k): T[w, j] = theta[w - j + pl]
    for 0 <= w - j + pl < c_k, so (S T)[i, j] = sum_b theta[b] S[i, j + b - pl]."""
    ck = theta_row.shape[-1]
    w = torch.arange(tk)[:, None]
    j = torch.arange(tk)[None, :]
    bidx = w - j + pl
    ok = (bidx >= 0) & (bidx < ck)
    return torch.where(ok, theta_row[:, bidx.clamp(0, ck - 1)], torch.zeros((), dtype=theta_row.dtype))


def toeplitz_conv(s: torch.Tensor, theta: torch.Tensor, pl: int, adjoint: bool = False) -> torch.Tensor:
    """The key-query convolution of (B, H, Tq, Tk) planes by (H, c_q, c_k) kernels as banded
    Toeplitz products, one per row shift: out = sum_a shift_rows(s, a - (c_q - 1)) T_a
    (``adjoint``: its adjoint, sum_a shift_rows(s, c_q - 1 - a) T_a^T)."""
    cq = theta.shape[1]
    out = torch.zeros_like(s)
    for a in range(cq):
        ta = toeplitz(theta[:, a].to(s.dtype), s.shape[-1], pl)  # (H, Tk, Tk)
        if adjoint:
            out = out + torch.matmul(shift_rows(s, cq - 1 - a), ta.transpose(-1, -2))
        else:
            out = out + torch.matmul(shift_rows(s, a - (cq - 1)), ta)
    return out


def kernel_grad(s: torch.Tensor, g: torch.Tensor, cq: int, ck: int, pl: int) -> torch.Tensor:
    """(H, c_q, c_k): d/dtheta of sum(g * conv_theta(s)) = sum_{b, i, j} g[i, j] s[i + a - (c_q-1), j + b - pl]
    (the diagonals of shift_rows(s)^T g, summed over the batch)."""
    tk = s.shape[-1]
    out = torch.zeros(s.shape[1], cq, ck, dtype=s.dtype)
    for a in range(cq):
        sa = shift_rows(s, a - (cq - 1))
        for b in range(ck):
            o = b - pl  # s[:, j + o]
            sh = torch.zeros_like(sa)
            if o >= 0:
                sh[..., :tk - o] = sa[..., o:]
            else:
                sh[..., -o:] = sa[..., :tk + o]
            out[:, a, b] = (g * sh).sum((0, 2, 3))
    return out


def mix(x: torch.Tensor, w: Optional[torch.Tensor], transpose: bool = False) -> torch.Tensor:
    """Head mixing out_g = sum_h w[g, h] x_h (``transpose``: by w^T, its adjoint)."""
    if w is None:
        return x
    return torch.einsum("hg,bhqk->bgqk" if transpose else "gh,bhqk->bgqk", w.to(x.dtype), x)


def mix_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d/dw of sum(g * mix(x, w)): sum over cells of g_g x_h."""
    return torch.einsum("bgqk,bhqk->gh", g, x)


# ----------------------------------------------------------------- the split
@dataclass
class Layer:
    """One call's fixed parts: the mask and the weights (None: off)."""

    k1: Optional[torch.Tensor]  # (H, c_q, c_k) pre-softmax kernel
    w1: Optional[torch.Tensor]  # (H, H) pre-softmax mixing (out, in)
    k2: Optional[torch.Tensor]  # (H, c_q', c_k') post-softmax kernel
    w2: Optional[torch.Tensor]  # (H, H) post-softmax mixing (``types.post_mix_matrix``)
    pad_key: str
    ok: torch.Tensor  # ``allowed``
    scale: float

    def pl1(self):
        return pad_left(self.pad_key, self.k1.shape[-1])

    def pl2(self):
        return pad_left(self.pad_key, self.k2.shape[-1])


def _zero(x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    return torch.where(ok, x, torch.zeros((), dtype=x.dtype))


def raw_scores(q, k, L: Layer) -> torch.Tensor:
    """S0 on the allowed cells, zero elsewhere (mask, then conv)."""
    return _zero(torch.matmul(q, k.transpose(-1, -2)) * L.scale, L.ok)


def pass_stats(q, k, L: Layer, store: TileStore) -> torch.Tensor:
    """C -> store; returns the (B, H, Tq) lse (0 on a row that allows nothing)."""
    s0 = raw_scores(q, k, L)
    c = toeplitz_conv(s0, L.k1, L.pl1()) if L.k1 is not None else s0
    store.write(c)
    return _lse(mix(store.read(_acc(q)), L.w1), L.ok)


def _acc(x):
    return torch.promote_types(x.dtype, torch.float32)


def _lse(z, ok):
    z = z.masked_fill(~ok, float("-inf"))
    m = z.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    tot = torch.exp(z - m).sum(-1)
    return torch.where(tot > 0, m.squeeze(-1) + torch.log(torch.where(tot > 0, tot, torch.ones_like(tot))),
                       torch.zeros_like(tot))


def _probs(store: TileStore, lse, L: Layer, dtype):
    z = mix(store.read(dtype), L.w1)
    return _zero(torch.exp(torch.clamp(z - lse[..., None], max=0.0)), L.ok)


def _post(p, L: Layer):
    return _zero(toeplitz_conv(p, L.k2, L.pl2()), L.ok) if L.k2 is not None else p


def pass_forward(v, lse, L: Layer, store: TileStore) -> torch.Tensor:
    p = _probs(store, lse, L, _acc(v)).to(v.dtype)
    return torch.matmul(mix(_post(p, L), L.w2), v)


def pass_rowsum(do, v, lse, L: Layer, store: TileStore):
    """Kernel A, first launch: D = rowsum(P * dP). Returns (D, dP, dR, dA) (the prototype hands
    dP, dR, dA on; a kernel recomputes them in its second launch)."""
    p = _probs(store, lse, L, _acc(v)).to(v.dtype)
    da = torch.matmul(do, v.transpose(-1, -2))
    dr = _zero(mix(da, L.w2, transpose=True), L.ok)
    dp = _zero(toeplitz_conv(dr, L.k2, L.pl2(), adjoint=True), L.ok) if L.k2 is not None else dr
    return (p * dp).sum(-1), dp, dr, da


def pass_dc(do, v, lse, dd, dp, dr, da, L: Layer, store: TileStore, dstore: TileStore) -> dict:
    """Kernel A, second launch: dC -> dstore; dv and the gradients of W1, W2, theta2."""
    c = store.read(_acc(v))
    p = _probs(store, lse, L, _acc(v)).to(v.dtype)
    r = _post(p, L)
    a = mix(r, L.w2)
    dz = p * (dp - dd[..., None])
    dstore.write(mix(dz, L.w1, transpose=True))
    out = {"v": torch.matmul(a.transpose(-1, -2), do)}
    if L.w1 is not None:
        out["w1"] = mix_grad(dz, _zero(c, L.ok))
    if L.w2 is not None:
        out["w2"] = mix_grad(da, r)
    if L.k2 is not None:
        out["k2"] = kernel_grad(p, dr, *L.k2.shape[1:], L.pl2())
    return out


def pass_b(q, k, L: Layer, dstore: TileStore) -> dict:
    """Kernel B: dC (read from the store) -> dq, dk, theta1's gradient."""
    dc = dstore.read(_acc(q))
    if L.k1 is not None:
        s0 = raw_scores(q, k, L)
        ds = _zero(toeplitz_conv(dc, L.k1, L.pl1(), adjoint=True), L.ok)
        out = {"k1": kernel_grad(s0, dc, *L.k1.shape[1:], L.pl1())}
    else:
        ds, out = _zero(dc, L.ok), {}
    out["q"] = torch.matmul(ds, k) * L.scale
    out["k"] = torch.matmul(ds.transpose(-1, -2), q) * L.scale
    return out


def attention(q, k, v, k1, w1, k2, w2, pad_key: str = "both", q_off: int = 0, key_valid=None,
              tile: tuple[int, int] = (16, 16), do: Optional[torch.Tensor] = None):
    """The whole split: (O, grads | None, stores). ``do``: the output's gradient (None: forward
    only). Stores keep C and dC in q's dtype, tiles of ``tile`` cells."""
    b, h, tq, _ = q.shape
    tk = k.shape[2]
    L = Layer(k1, w1, k2, w2, pad_key, allowed(tq, tk, q_off, key_valid), q.shape[-1] ** -0.5)
    store = TileStore(b, h, tq, tk, q_off, *tile, q.dtype)
    lse = pass_stats(q, k, L, store)
    o = pass_forward(v, lse, L, store)
    if do is None:
        return o, None, (store,)
    dd, dp, dr, da = pass_rowsum(do, v, lse, L, store)
    dstore = TileStore(b, h, tq, tk, q_off, *tile, q.dtype)
    grads = pass_dc(do, v, lse, dd, dp, dr, da, L, store, dstore)
    grads.update(pass_b(q, k, L, dstore))
    return o, grads, (store, dstore)


def plane_bytes(b: int, h: int, t: int, bm: int, bn: int, dtype: torch.dtype) -> int:
    """Bytes of one stored (B, H, T, T) plane (C or dC) of the causal tiles."""
    return b * h * stored_tiles(t, t, 0, bm, bn) * bm * bn * torch.empty((), dtype=dtype).element_size()


__all__ = ["TileStore", "attention", "plane_bytes", "stored_tiles", "toeplitz_conv", "kernel_grad"]
