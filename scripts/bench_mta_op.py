"""mta_repro.mta's op beside the other MTA implementations and SDPA, on one layer's core
(q, k, v -> output), the same shapes in one run: fwd+bwd time, peak memory, bytes saved
for backward.

    python scripts/bench_mta_op.py                                  # CPU fp32, T = 512, 1024, 2048
    python scripts/bench_mta_op.py --release RAM/projects/mta/mta_transformer.py   # + the release's layer
    TRITON_INTERPRET=1 python scripts/bench_mta_op.py --liger --seqs 512           # + Liger in the interpreter
    python scripts/bench_mta_op.py --device cuda --dtype bfloat16 --liger --release ...

Cases (the release's 830M layer: 16 heads of 96, B = 1):
  sdpa      F.scaled_dot_product_attention, causal: the baseline layer
  op        multi_token_attention: 6x11 key-query convolutions before and after softmax,
            wpsm, head convolution over 16 (the release's MTA layer), attn_impl=blocked
  op_torch  the same through attn_impl=torch (the whole score matrix kept, as the release)
  release   the release's own Attention (facebookresearch/RAM projects/mta, a file given
            with --release; never part of this repository), the same weights, its q/k/v
            handed in through its projections; its lingua/xformers imports stubbed, its
            device="cuda" tensors made on the run's device
  op_post   multi_token_attention with only a 5x11 post-softmax convolution
  liger     Liger-Kernel's LigerMultiTokenAttention on q k^T / sqrt(d), then @ v: the same 5x11
            post-softmax convolution (its symmetric padding needs an odd c_q, and reads later
            query rows where the op reads earlier ones), with --liger; its Triton kernels need
            CUDA or TRITON_INTERPRET=1, an emulator whose times measure the interpreter

Each (case, T) runs in fresh subprocesses, as scripts/bench_attention.py does: times are the
median of --reps after one warm-up; on CPU the peak is the RSS above the one before the
inputs existed, measured in a second process with glibc's mmap threshold at 1 MiB; "saved"
is the bytes autograd keeps for backward beyond the inputs (saved_tensors_hooks, each
storage once). Ratios are against SDPA at the same T, from the same invocation. The columns
of the device not run say "not yet measured".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

from benchlib import median_seconds, peak_rss_gb, ratio, run_child, sync, write_rows

ROOT = Path(__file__).resolve().parents[1]
H, D, B = 16, 96, 1
CASES = ("sdpa", "op", "op_torch", "release", "op_post", "liger")


def mta_weights(dev, dtype, seed: int = 0) -> dict:
    """The release's MTA layer: 6x11 kernels before and after softmax, wpsm, head_kernel over
    16 heads; identity plus 0.1 N(0, 1), so every part computes."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def w(*shape, eye=None):
        t = 0.1 * torch.randn(*shape, generator=g)
        if eye is not None:
            t = t + eye
        return t.to(dev, dtype).requires_grad_()

    return {
        "mta_kernel": w(H, 1, 6, 11),
        "wpsm": w(H, H, eye=torch.eye(H)),
        "mta_kernel_after_sm": w(H, 1, 6, 11),
        "head_kernel": w(1, H, H, eye=torch.eye(H)),
    }


def load_release(src: Path, device: str) -> types.ModuleType:
    """The release's mta_transformer.py as a module: its lingua/xformers imports stubbed
    (q and k come in rotated, K/V heads equal the query heads), device="cuda" made ``device``."""
    import torch

    lt = types.ModuleType("lingua.transformer")

    def repeat_kv(x, n_rep, dim):
        assert n_rep == 1 and dim == 2, "the benchmark runs the release without grouped-query attention"
        return x

    lt.repeat_kv = repeat_kv
    lt.apply_rotary_emb = lambda xq, xk, seq_dim, freq_cis: (xq, xk)
    lt.FeedForward = lt.InitStdFactor = lt.RotaryEmbedding = object
    xo = types.ModuleType("xformers.ops")
    xo.AttentionBias, xo.fmha = object, None
    sys.modules.update(
        {
            "lingua": types.ModuleType("lingua"),
            "lingua.transformer": lt,
            "xformers": types.ModuleType("xformers"),
            "xformers.ops": xo,
        }
    )
    text = src.read_text()
    if not device.startswith("cuda"):
        text = text.replace('device="cuda"', f'device="{device}"').replace(".cuda()", "")
    mod = types.ModuleType("release_mta_transformer")
    sys.modules[mod.__name__] = mod  # its dataclasses look their module up
    exec(compile(text, str(src), "exec"), mod.__dict__)
    del torch
    return mod


def build(case: str, seq: int, dev, dtype, release_src=None):
    """(fwd, inputs): fwd() -> output (B, T, H*d); inputs are the leaves (q, k, v in the
    (B, T, H, d) layout of a model's projections, and the weights)."""
    import torch
    import torch.nn.functional as F

    from mta_repro.mta import multi_token_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, seq, H, D, generator=g).to(dev, dtype).requires_grad_() for _ in range(3))
    heads = lambda t: t.transpose(1, 2)  # noqa: E731 - (B, T, H, d) -> (B, H, T, d), a view
    flat = lambda o: o.transpose(1, 2).reshape(B, seq, H * D)  # noqa: E731
    if case == "sdpa":
        return (lambda: flat(F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True))), [q, k, v]
    if case in ("op", "op_torch"):
        w = mta_weights(dev, dtype)
        impl = "blocked" if case == "op" else "torch"
        return (lambda: flat(multi_token_attention(heads(q), heads(k), heads(v), **w, attn_impl=impl))), [
            q,
            k,
            v,
            *w.values(),
        ]
    if case == "op_post":
        kernel = (0.1 * torch.randn(H, 1, 5, 11, generator=g)).to(dev, dtype).requires_grad_()
        return (lambda: flat(multi_token_attention(heads(q), heads(k), heads(v), kq_kernel_after_softmax=kernel))), [
            q,
            k,
            v,
            kernel,
        ]
    if case == "liger":
        from liger_kernel.transformers.multi_token_attention import LigerMultiTokenAttention

        layer = LigerMultiTokenAttention(H, H, kernel_size=(5, 11), padding=(2, 5), groups=H, bias=False).to(dev, dtype)

        def fwd():
            s = heads(q) @ heads(k).transpose(-1, -2) * D**-0.5
            return flat(layer(s) @ heads(v))

        return fwd, [q, k, v, layer.weight]
    if case == "release":
        return build_release(release_src, seq, dev, dtype, q, k, v)
    raise SystemExit(f"unknown case {case!r}; cases: {', '.join(CASES)}")


def build_release(src, seq, dev, dtype, q, k, v):
    import torch
    from torch import nn

    if src is None:
        raise SystemExit("the release case needs --release PATH/TO/projects/mta/mta_transformer.py")
    mod = load_release(Path(src), str(dev))
    mta = mod.MTATransformerArgs(
        use_mta=True,
        query_kernel_size=6,
        key_kernel_size=11,
        after_sm_query_kernel_size=6,
        after_sm_key_kernel_size=11,
        pad_key="both",
        pre_sm_linear_head=True,
        head_kernel_size=H,
    )
    layer = mod.Attention(
        dim=H * D,
        head_dim=D,
        n_heads=H,
        n_kv_heads=H,
        rope_theta=1e4,
        cache_attention_maps=False,
        max_seq_len=seq,
        mta=mta,
        dropout=0.0,
        layer_id=2,
    ).to(dev, dtype)
    w = mta_weights(dev, dtype)
    with torch.no_grad():
        layer.mta_kernel.copy_(w["mta_kernel"])
        layer.wpsm.weight.copy_(w["wpsm"])
        layer.mta_kernel_after_sm.copy_(w["mta_kernel_after_sm"])
        layer.head_kernel.copy_(w["head_kernel"])

    class Given(nn.Module):  # the projection hands over a given tensor
        def __init__(self, t):
            super().__init__()
            self.t = t

        def forward(self, x):
            return self.t.reshape(B, seq, H * D)

    layer.wq, layer.wk, layer.wv, layer.wo = Given(q), Given(k), Given(v), nn.Identity()
    x = torch.empty(B, seq, H * D, device=dev, dtype=dtype)
    freqs = torch.zeros(seq, device=dev)
    params = [layer.mta_kernel, layer.wpsm.weight, layer.mta_kernel_after_sm, layer.head_kernel]
    return (lambda: layer(x, freqs)), [q, k, v, *params]


def run_one(case: str, seq: int, device: str, dtype_name: str, reps: int, release_src) -> dict:
    import torch

    dev, dtype = torch.device(device), getattr(torch, dtype_name)
    rss0 = peak_rss_gb()
    fwd, inputs = build(case, seq, dev, dtype, release_src)
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fwd()  # only counted: hooks that keep the tensors themselves skip autograd's version checks
    ins = {t.untyped_storage().data_ptr() for t in inputs}
    saved = sum(n for ptr, n in storages.items() if ptr not in ins)
    row = {"case": case, "seq": seq, "saved_mb": saved / 2**20, "device": device, "dtype": dtype_name}
    out = fwd()
    try:
        out.backward(torch.ones_like(out))
        backward = True
    except RuntimeError as e:  # the release's in-place masking of the probabilities, in float32
        row["backward_error"] = " ".join(str(e).split())[:160]
        backward = False
    del out
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    def step():
        o = fwd()
        if backward:
            o.backward(torch.ones_like(o))

    row["fwd_s"], _ = median_seconds(fwd, reps, dev, warmup=0)
    row["s"], row["s_all"] = median_seconds(step, reps, dev, warmup=0)
    row["fwd_only"] = not backward
    row["peak_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else peak_rss_gb() - rss0
    return row


def parity(seq: int, device: str, dtype_name: str, release_src) -> str:
    """The op's output against the release's layer (same weights and inputs), max |diff|."""
    import torch

    dev, dtype = torch.device(device), getattr(torch, dtype_name)
    fwd_r, _ = build("release", seq, dev, dtype, release_src)
    fwd_o, _ = build("op", seq, dev, dtype)
    with torch.no_grad():
        diff = (fwd_r().float() - fwd_o().float()).abs().max().item()
    return f"op vs release, T={seq} {dtype_name}: max |diff| of the outputs {diff:.2e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="512,1024,2048")
    ap.add_argument("--cases", default=None, help="comma list (default: every case that can run here)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--release",
        default=None,
        metavar="MTA_TRANSFORMER_PY",
        help="the release's projects/mta/mta_transformer.py (facebookresearch/RAM), run beside the op",
    )
    ap.add_argument("--liger", action="store_true", help="run Liger-Kernel's LigerMultiTokenAttention too")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--one", nargs=2, metavar=("CASE", "T"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one[0], int(a.one[1]), a.device, a.dtype, a.reps, a.release)))
        return
    skipped = {}
    if a.release is None:
        skipped["release"] = "no --release file (fetch facebookresearch/RAM and pass projects/mta/mta_transformer.py)"
    if not a.liger:
        skipped["liger"] = "not asked for (--liger)"
    elif not a.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        skipped["liger"] = (
            "its Triton kernels need CUDA; on CPU only Triton's interpreter runs them "
            "(TRITON_INTERPRET=1), an emulator: its time is the interpreter's"
        )
    else:
        import importlib.util

        if importlib.util.find_spec("liger_kernel") is None:
            skipped["liger"] = "liger-kernel is not installed (pip install liger-kernel)"
    cases = a.cases.split(",") if a.cases else [c for c in CASES if c not in skipped]
    rows = []
    for seq in map(int, a.seqs.split(",")):
        for case in cases:
            cmd = [sys.executable, __file__, "--one", case, str(seq), "--device", a.device, "--dtype", a.dtype]
            if a.release:
                cmd += ["--release", a.release]
            peak_cmd = [*cmd, "--reps", "1"] if a.device == "cpu" else None
            r = run_child([*cmd, "--reps", str(a.reps)], ROOT, f"{case}/T={seq}", peak_cmd)
            if r is None:
                continue
            rows.append(r)
            print(
                f"  {case:8s} T={seq:5d} {r['s']:8.3f} s  peak {r['peak_gb']:.2f} GB  saved {r['saved_mb']:.1f} MB"
                + ("  (forward only: backward fails)" if r["fwd_only"] else ""),
                file=sys.stderr,
                flush=True,
            )
    report(rows, a, skipped)
    write_rows(a.json, rows)


def report(rows: list, a, skipped: dict) -> None:
    sdpa = {r["seq"]: r for r in rows if r["case"] == "sdpa"}
    gpu = a.device.startswith("cuda")
    mem = "peak GB" + ("" if gpu else " (RSS)")
    print(
        f"\nOne layer's core, fwd+bwd, B={B}, {H} heads of {D}, {a.device} {a.dtype}, median of {a.reps} "
        "after 1 warm-up\n"
    )
    print(
        f"| case | T | CPU fwd+bwd s | x SDPA | CPU fwd s | x SDPA | CPU {mem} | saved MB | GPU fwd+bwd s | "
        "GPU peak GB |"
    )
    print("|" + "---|" * 10)
    nym = "not yet measured"
    for r in rows:
        b = sdpa.get(r["seq"])
        both = ["backward fails", "-"] if r["fwd_only"] else [f"{r['s']:.3f}", ratio(r, b, "s")]
        ours = [*both, f"{r['fwd_s']:.3f}", ratio(r, b, "fwd_s"), f"{r['peak_gb']:.2f}"]
        cpu, gpus = (["-"] * 5, [ours[0], ours[4]]) if gpu else (ours, [nym, nym])
        print(f"| {r['case']} | {r['seq']} | {' | '.join(cpu)} | {r['saved_mb']:.1f} | {' | '.join(gpus)} |")
    for case, why in skipped.items():
        print(f"\n{case}: not run ({why})")
    for r in rows:
        if r.get("backward_error") and r["seq"] == min(x["seq"] for x in rows):
            print(f"\n{r['case']}: backward raised ({r['backward_error']}); its peak is the forward's")
    if a.release and "release" in {r["case"] for r in rows}:
        print("\n" + parity(min(r["seq"] for r in rows), a.device, a.dtype, a.release))


if __name__ == "__main__":
    main()
