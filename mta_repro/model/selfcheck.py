"""The attention implementations checked on the device they will train on, before they
train, and the fallback when one is wrong there.

Every explicit-path layer kind of a model (``kq_conv``: the key-query convolutions and
head mixing; ``mixing``: head mixing only) is run at a small shape (B=1, the model's heads
and head size, T=256, its kernels with random weights) through the implementation the
model asks for, in the run's dtype on the run's device, forward and backward, and compared
with the ``torch`` reference in float64: the output and the gradient of q, k, v and every
score-path weight, each as its largest error relative to the reference's largest entry.
A check passes when each error is within ``4 x`` the ``torch`` path's own error in the same
dtype ``+ 1e-3`` (``within_tolerance``; the rule of scripts/gpu_acceptance.py's parity
section): the floor that dtype allows, with room for a different summation order. An
exception, a wrong shape or a non-finite value fails it.

A failing implementation is replaced by its registry entry's ``fallback``
(``attention_registry.fallback_chain``), e.g. for the built-in ones::

    blocked -> blocked+conv2d -> torch

(``blocked+conv2d``: ``blocked`` with ATen's ``F.conv2d`` for the key-query convolutions
instead of the C/Triton kernel); an implementation registered elsewhere names its own.
The trainer (``mta_repro.train.attn_selfcheck``) runs this once per process and configuration
(``model.attn_selfcheck``; the result is cached) and records what ran.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from mta_repro.errors import UserError
from mta_repro.model import attention_ops
from mta_repro.model.args import ModelArgs

CHECK_T = 256  # query/key length of the check: every halo and several blocks, milliseconds
# The error allowed beyond the torch path's own (same dtype): ``within_tolerance``.
REL_FACTOR, ABS_SLACK = 4.0, 1e-3


def within_tolerance(err: float, torch_err: float) -> bool:
    """The parity rule: ``err <= 4 x torch_err + 1e-3`` (both relative to the float64
    reference's largest entry); a non-finite error never passes."""
    return math.isfinite(err) and err <= REL_FACTOR * torch_err + ABS_SLACK


def next_impl(name: str) -> str | None:
    """The implementation tried after ``name`` fails: its registry entry's ``fallback`` (None
    after ``torch``, the reference)."""
    return attention_ops.attn_impl(name).fallback


def applied(args: ModelArgs, name: str) -> ModelArgs:
    """``args`` running implementation ``name`` (``attn_impl`` alone; the tuning is kept)."""
    return dataclasses.replace(args, attn_impl=name)


@dataclass
class LayerCheck:
    """One implementation on one layer kind: the errors (output, worst gradient) beside the
    torch path's in the same dtype, or why it could not run."""

    impl: str
    layer: str  # "kq_conv" | "mixing"
    ok: bool
    out_err: float | None = None
    grad_err: float | None = None
    torch_err: tuple | None = None
    reason: str | None = None

    def line(self) -> str:
        if self.reason is not None:
            return f"{self.layer} layer: {self.reason}"
        assert self.torch_err is not None
        (t_out, t_grad) = self.torch_err
        return (
            f"{self.layer} layer: output error {self.out_err:.1e} (allowed {REL_FACTOR:g} x {t_out:.1e} + "
            f"{ABS_SLACK:g}), gradient error {self.grad_err:.1e} (allowed {REL_FACTOR:g} x {t_grad:.1e} + "
            f"{ABS_SLACK:g})"
        )


@dataclass
class Decision:
    """What the check chose: ``used`` (the requested name or one of its fallbacks),
    every check it ran, in order, and the device and dtype it ran them in."""

    requested: str
    used: str
    device: str
    dtype: str
    checks: list = field(default_factory=list)

    @property
    def fell_back(self) -> bool:
        return self.used != self.requested

    def as_dict(self) -> dict:
        return {
            "requested": self.requested,
            "used": self.used,
            "device": self.device,
            "dtype": self.dtype,
            "checks": [dataclasses.asdict(c) for c in self.checks],
        }


def explicit_layer_kinds(args: ModelArgs) -> dict[str, int]:
    """{layer kind: first layer id} of the explicit-path kinds the model has."""
    out: dict[str, int] = {}
    for i in range(args.n_layers):
        kind = args.layer_kind(i)
        if kind in ("kq_conv", "mixing") and kind not in out:
            out[kind] = i
    return out


def _layer_params(args: ModelArgs, layer_id: int, seed: int) -> attention_ops.ExplicitAttnParams:
    """The score-path weights of layer ``layer_id`` at their shapes, float64 on the CPU:
    the model's init plus noise (an identity kernel alone would leave the convolutions
    untested), dropout off (the check compares deterministic paths)."""
    from mta_repro.model.transformer import Attention

    with torch.device("meta"):
        shapes = Attention(args, layer_id).explicit_params()
    g = torch.Generator().manual_seed(seed)
    ws = {}
    for f in attention_ops.WEIGHT_FIELDS:
        t = getattr(shapes, f)
        if t is None:
            continue
        noise = 0.1 * torch.randn(*t.shape, generator=g, dtype=torch.float64)
        if f in ("wpsm", "wposm"):
            noise += torch.eye(t.shape[0], dtype=torch.float64)
        elif f == "head_kernel":
            noise += torch.eye(t.shape[1], dtype=torch.float64).expand_as(noise)
        ws[f] = noise
    return dataclasses.replace(shapes, **ws, dropout=0.0)


def _run(name: str, q64, k64, v64, p64, gy64, device, dtype):
    """(output, gradients) of implementation ``name`` in ``dtype`` on ``device``, float64 copies."""
    wdtype = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (x.to(device, dtype).detach().clone().requires_grad_() for x in (q64, k64, v64))
    fields = [f for f in attention_ops.WEIGHT_FIELDS if getattr(p64, f) is not None]
    ws = {f: getattr(p64, f).to(device, wdtype).detach().clone().requires_grad_() for f in fields}
    p = dataclasses.replace(p64, **ws)
    mask = attention_ops.AttnMask()
    entry = attention_ops.attn_impl(name)
    if entry.supports is not None:
        why = entry.supports(q, p, mask)
        if why is not None:
            raise _Unsupported(why)
    out = entry.fn(q, k, v, p, mask, True)
    if out.shape != q.shape:
        raise RuntimeError(f"output shape {tuple(out.shape)}, expected {tuple(q.shape)}")
    out.backward(gy64.to(device, dtype))
    return out.detach().double().cpu(), [
        t.grad.double().cpu() if t.grad is not None else None for t in (q, k, v, *ws.values())
    ]


class _Unsupported(Exception):
    pass


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    if a is None:
        return float("nan")
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _errors(got, want) -> tuple[float, float]:
    out, grads = got
    w_out, w_grads = want
    return _rel(out, w_out), max(_rel(a, b) for a, b in zip(grads, w_grads))


def check_layer(
    name: str, args: ModelArgs, kind: str, layer_id: int, device: torch.device, dtype: torch.dtype, T: int = CHECK_T
) -> LayerCheck:
    """Implementation ``name`` on one layer kind, against the float64 reference."""
    H, d = args.n_heads, args.resolved_head_dim
    g = torch.Generator().manual_seed(1000 + layer_id)
    q64, k64, v64, gy64 = (torch.randn(1, H, T, d, generator=g, dtype=torch.float64) for _ in range(4))
    p64 = _layer_params(args, layer_id, seed=layer_id)
    want = _run("torch", q64, k64, v64, p64, gy64, device, torch.float64)
    torch_err = _errors(_run("torch", q64, k64, v64, p64, gy64, device, dtype), want)
    try:
        got = _run(name, q64, k64, v64, p64, gy64, device, dtype)
    except _Unsupported as e:
        return LayerCheck(name, kind, False, torch_err=torch_err, reason=f"not supported here ({e})")
    except Exception as e:  # noqa: BLE001 - any failure of the implementation is the finding
        text = " ".join(str(e).split())[:200]
        return LayerCheck(name, kind, False, torch_err=torch_err, reason=f"{type(e).__name__}: {text}")
    out_err, grad_err = _errors(got, want)
    ok = within_tolerance(out_err, torch_err[0]) and within_tolerance(grad_err, torch_err[1])
    reason = None
    if not (math.isfinite(out_err) and math.isfinite(grad_err)):
        reason = "non-finite output or gradient (NaN/inf)"
    return LayerCheck(name, kind, ok, out_err, grad_err, torch_err, reason)


_cache: dict = {}


def decide(args: ModelArgs, device: torch.device, dtype: torch.dtype, strict: bool = False, log=None) -> Decision:
    """Check ``args.attn_impl`` on every explicit layer kind of the model; on a failure,
    one line (``log``) naming it, the error and the fallback, and the next implementation
    of the chain is checked in turn. ``strict``: a failure raises ``SelfCheckError``
    instead. Cached per process (configuration, device, dtype)."""
    key = (repr(args), str(device), str(dtype), strict)
    if key in _cache:
        return _cache[key]
    dname = str(dtype).removeprefix("torch.")
    decision = Decision(args.attn_impl, args.attn_impl, str(device), dname)
    kinds = explicit_layer_kinds(args)
    attention_ops.fallback_chain(args.attn_impl)  # one line where the fallbacks go round in a circle
    name: str | None = args.attn_impl
    while name is not None and kinds:
        checks = [check_layer(name, args, kind, lid, device, dtype) for kind, lid in kinds.items()]
        decision.checks += checks
        bad = [c for c in checks if not c.ok]
        if not bad:
            decision.used = name
            break
        nxt = next_impl(name)
        what = "; ".join(c.line() for c in bad)
        if nxt is None:  # the reference itself, against float64: nothing is left to fall back to
            raise SelfCheckError(
                f"attention self-check: even model.attn_impl=torch fails on {device} in {dname} "
                f"({what}): this device cannot run the explicit attention path"
            )
        if strict:
            raise SelfCheckError(
                f"attention self-check: model.attn_impl={name} is wrong on {device} in {dname} ({what}); "
                "model.attn_selfcheck=strict refuses to train (model.attn_selfcheck=warn would fall back to "
                f"{nxt})"
            )
        if log is not None:
            log(
                f"attention self-check: model.attn_impl={name} failed on {device} in {dname} ({what}); "
                f"falling back to {nxt}"
            )
        name = nxt
    _cache[key] = decision
    return decision


class SelfCheckError(UserError):
    """An implementation failed the check under ``model.attn_selfcheck=strict``, or nothing
    is left to fall back to (one line, rc 2 on the command line)."""
