"""What the model hands a kernel: the mask's structure, a layer's score-path parameters and
where a key-query kernel sits on the key axis (``pad_key``). ``mta_repro.model.attention_ops``
(which picks an implementation) and the kernels (which implement one, the experimental
Triton kernels included) all import them from here, so none imports another to know them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mta_repro.kernels.tuning import DEFAULT_TUNING, KernelTuning


@dataclass(frozen=True)
class AttnMask:
    """The structure of the attention mask: causal from ``q_offset``, minus padding.

    Implementations receive this instead of a dense (Tq, Tk) tensor, so a blocked or
    fused kernel builds only the tiles it needs. key_valid: (B, Tk) bool, False at pad
    positions of left-padded batches (None: no padding).
    """

    q_offset: int = 0
    key_valid: torch.Tensor | None = None

    def dense(self, tq: int, tk: int, device: torch.device) -> torch.Tensor:
        return allowed_mask(tq, tk, self.q_offset, device, self.key_valid)


def allowed_mask(
    tq: int,
    tk: int,
    q_offset: int,
    device: torch.device,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which (query, key) pairs may interact: causal, minus padding.

    Returns bool (1, 1, Tq, Tk), or (B, 1, Tq, Tk) when ``key_valid`` (B, Tk) marks real
    (non-pad) positions. A pad query row is all False, so in the explicit path it
    contributes exactly the zeros that the convolution's own padding would.
    """
    qpos = torch.arange(tq, device=device)[:, None] + q_offset
    kpos = torch.arange(tk, device=device)[None, :]
    mask = (kpos <= qpos)[None, None]
    if key_valid is not None:
        q_valid = key_valid[:, q_offset : q_offset + tq]
        mask = mask & key_valid[:, None, None, :] & q_valid[:, None, :, None]
    return mask


@dataclass
class ExplicitAttnParams:
    """The score-path parameters of one layer (None = that part is off)."""

    mta_kernel: torch.Tensor | None = None  # (H, 1, c_q, c_k), before softmax
    wpsm: torch.Tensor | None = None  # (H, H), before softmax
    mta_kernel_after_sm: torch.Tensor | None = None  # (H, 1, c_q', c_k'), after softmax
    head_kernel: torch.Tensor | None = None  # (H/c_h, c_h, c_h), after softmax
    wposm: torch.Tensor | None = None  # (H, H), after softmax
    pad_key: str = "both"
    dropout: float = 0.0
    # Query rows per block of the ``blocked`` implementation (``model.attn_block_size``);
    # None: ``default_block_size`` of the tensors' device.
    block_size: int | None = None
    # Kernel of the key-query convolutions (``kq_conv_backend``); None: chosen per call.
    # ``blocked`` fixes it once per call, outside the (compiled, recomputed) block, so the
    # forward and its recomputation agree and Dynamo traces no environment look-ups.
    kq_backend: str | None = None
    # The model's tuning (``model.kernels``): tiles, frames, programs of the kernels.
    tuning: KernelTuning = field(default_factory=lambda: DEFAULT_TUNING)


def post_mix_matrix(p: ExplicitAttnParams) -> torch.Tensor | None:
    """The post-softmax head mixing as one (H_out, H_in) matrix: ``wposm`` itself, or the
    block-diagonal matrix of the grouped ``head_kernel`` (out g*c_h+j <- in g*c_h+i)."""
    if p.head_kernel is not None:
        return torch.block_diag(*p.head_kernel.transpose(1, 2))
    return p.wposm


def pad_left(pad_key: str, c_k: int) -> int:
    """Keys padded before the window (the kernel's key offset 0 sits at this column):
    the release's ``pad_key`` = "both" / "left" / "right" for a kernel of c_k keys."""
    return {"both": (c_k - 1) // 2, "left": c_k - 1, "right": 0}[pad_key]
