"""The paper's figures as PNG: needles, BabiLong, loss curves, learned MTA kernels."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mta_repro.report.runs import RunData, results_of, results_or_none  # noqa: E402


def _ctx_label(label: str, ctx) -> str:
    ctx = int(ctx)
    return f"{label} ({ctx // 1024}K)" if ctx % 1024 == 0 else f"{label} ({ctx} tokens)"


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=120, bbox_inches="tight")  # legends outside the axes stay in
    plt.close(fig)
    return path


def needle_plot(runs, out: Path) -> Path | None:
    have = [r for r in runs if results_or_none(r, "needle")]
    if not have:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    all_counts, all_depths = set(), set()
    lines = [
        (r, ctx, per)
        for r in have
        for ctx, per in sorted(results_of(r, "needle")["accuracy"].items(), key=lambda kv: int(kv[0]))
    ]
    for color, (r, ctx, per) in zip(palette(len(lines)), lines):
        counts = sorted(per, key=int)
        ax1.plot(
            [int(n) for n in counts],
            [100 * per[n]["mean"] for n in counts],
            marker="o",
            color=color,
            label=_ctx_label(r.label, ctx),
        )
        depths = sorted({d for n in counts for d in per[n]["by_depth"]}, key=float)
        acc = [100 * sum(per[n]["by_depth"][d] for n in counts) / len(counts) for d in depths]
        ax2.plot([float(d) for d in depths], acc, marker="s", color=color, label=_ctx_label(r.label, ctx))
        all_counts.update(int(n) for n in counts)
        all_depths.update(float(d) for d in depths)
    ax1.set_xticks(sorted(all_counts))
    ax2.set_xticks(sorted(all_depths))
    ax1.set(
        xlabel="number of needles",
        ylabel="accuracy (%)",
        title="Accuracy by needle count (mean over depths)",
        ylim=(-2, 102),
    )
    ax2.set(
        xlabel="depth of the first needle (%)",
        ylabel="accuracy (%)",
        title="Accuracy by depth (mean over needle counts)",
        ylim=(-2, 102),
    )
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out / "needle.png")


def babilong_plot(runs, out: Path) -> Path | None:
    have = [r for r in runs if results_or_none(r, "babilong")]
    if not have:
        return None
    tasks = sorted({t for r in have for t in results_of(r, "babilong")["accuracy"]}) + ["mean"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3.4), sharey=True, squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for r in have:
            res = results_of(r, "babilong")
            vals = res["mean"] if task == "mean" else res["accuracy"].get(task, {})
            lengths = list(vals)
            ax.plot(range(len(lengths)), [100 * vals[x] for x in lengths], marker="o", label=r.label)
            ax.set_xticks(range(len(lengths)), lengths)
        ax.set(title=task.upper() if task != "mean" else "QA1-QA5 mean", xlabel="context length", ylim=(-2, 102))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (%)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out / "babilong.png")


def loss_series(run) -> dict:
    """{series name: [(step, loss)]}: the training loss and the validation loss logged
    during training (``val_loss``, the mean over domains, as the eval's; ln of ``val_ppl``
    for logs that only have the perplexity). Per-domain keys (``val_loss/<domain>``) stay
    in metrics.jsonl: one line per run keeps the plot readable."""
    out = {}
    pts = [(m["step"], m["loss"]) for m in run.metrics if "step" in m and isinstance(m.get("loss"), (int, float))]
    if pts:
        out["train"] = pts

    def series(key):
        return [
            (m["step"], m[key])
            for m in run.metrics
            if "step" in m and isinstance(m.get(key), (int, float)) and not isinstance(m.get(key), bool)
        ]

    if series("val_loss"):
        out["val_loss"] = series("val_loss")
    elif series("val_ppl"):
        out["val_ppl (ln)"] = [(s, math.log(v)) for s, v in series("val_ppl") if v > 0]
    return out


def _validation_sizes(run) -> tuple:
    """(training's validation, the eval's ppl) as 'B batches x W windows of T tokens'."""
    cfg = run.config or {}
    tr, data = cfg.get("trainer") or {}, cfg.get("data") or {}
    train = None
    if tr.get("eval_max_batches") and data.get("seq_len"):
        train = (
            f"at most {tr['eval_max_batches']} batches x {tr.get('eval_batch_size', 4)} windows of "
            f"{data['seq_len']} tokens per domain"
        )
    res = results_or_none(run, "ppl")
    ev = None
    if res:
        mb = res.get("max_batches")
        ev = (
            f"{'all' if mb is None else f'at most {mb}'} batches x {res.get('batch_size', '?')} windows of "
            f"{res.get('seq_len', '?')} tokens per domain"
        )
    return train, ev


def palette(n: int) -> list:
    """``n`` colours that stay apart: matplotlib's 10-colour cycle up to 10, tab20 up to
    20 (a 12-point sweep no longer gives points 1 and 11 one colour), beyond that evenly
    spaced hues of ``turbo``."""
    if n <= 10:
        return [plt.get_cmap("tab10")(i) for i in range(n)]
    if n <= 20:
        return [plt.get_cmap("tab20")(i) for i in range(n)]
    return [plt.get_cmap("turbo")(0.05 + 0.9 * i / (n - 1)) for i in range(n)]


def _seed_band(pts_by_seed: list) -> tuple:
    """(steps, mean, lo, hi) over the seeds' curves at the steps every seed logged
    (lo/hi: the lowest and highest seed)."""
    import numpy as np

    common = sorted(set.intersection(*[{s for s, _ in pts} for pts in pts_by_seed]))
    vals = np.array([[dict(pts)[s] for s in common] for pts in pts_by_seed], dtype=np.float64)
    return common, vals.mean(axis=0), vals.min(axis=0), vals.max(axis=0)


def loss_plot(runs, out: Path) -> Path | None:
    """One colour per run, or per group of seeds (``pretrain/mta/seed0..2``: their mean,
    with a band from the lowest to the highest seed); line style says what: training
    loss (solid), the validation logged during training (dashed,
    trainer.eval_max_batches), the evaluation's token-weighted loss (star: the loss_seeds
    table's quantity, mean nats per token over eval/ppl.json's windows; a group's mean
    over seeds). Two small legends
    outside the axes: runs, and what the styles are (only those some run has)."""
    from matplotlib.lines import Line2D

    from mta_repro.report.aggregate import group_runs, token_loss

    have = [r for r in runs if r.metrics]
    if not have:
        return None
    groups = group_runs(have)
    fig, ax = plt.subplots(figsize=(9, 4.2))
    run_handles = []
    sizes = {}
    drew_val, drew_eval, banded = False, False, False
    for color, (label, seeds) in zip(palette(len(groups)), groups.items()):
        members = list(seeds.values())
        all_series = [loss_series(r) for r in members]
        trains = [s.get("train", []) for s in all_series]
        if len(members) > 1 and all(trains):
            steps, mean, lo, hi = _seed_band(trains)
            ax.plot(steps, mean, color=color, lw=1.2)
            ax.fill_between(steps, lo, hi, color=color, alpha=0.2, lw=0)
            banded = True
        else:
            for pts in trains:
                if pts:
                    ax.plot(*zip(*pts), color=color, lw=1.2)
        for series in all_series:
            for name, vp in series.items():
                if name != "train":
                    ax.plot(*zip(*vp), color=color, ls="--", marker=".")
                    drew_val = True
        evals = []
        for r, pts in zip(members, trains):
            loss = token_loss(r)
            if loss is not None:  # the loss_seeds table's quantity: mean nats per token, every window
                step = r.evals["ppl"].get("step") or (pts[-1][0] if pts else 0)
                evals.append((step, loss))
        if evals:
            ax.plot(
                [max(s for s, _ in evals)],
                [sum(v for _, v in evals) / len(evals)],
                color=color,
                marker="*",
                ms=12,
                ls="none",
            )
            drew_eval = True
        n = len(members)
        run_handles.append(Line2D([], [], color=color, lw=2, label=label + (f" ({n} seeds)" if n > 1 else "")))
        sizes[label] = _validation_sizes(members[0])
    train_size = next((t for t, _ in sizes.values() if t), None)
    eval_size = next((e for _, e in sizes.values() if e), None)
    style_handles = [Line2D([], [], color="0.3", lw=1.2, label="training loss")]
    if banded:
        style_handles[0].set_label("training loss (seeds: mean,\nband from lowest to highest seed)")
    if drew_val:
        style_handles.append(
            Line2D(
                [],
                [],
                color="0.3",
                ls="--",
                marker=".",
                label="validation during training" + (f"\n({train_size})" if train_size else ""),
            )
        )
    if drew_eval:
        style_handles.append(
            Line2D(
                [],
                [],
                color="0.3",
                marker="*",
                ms=10,
                ls="none",
                label="evaluation: token-weighted loss\n(loss_seeds table; mean over seeds)"
                + (f"\n({eval_size})" if eval_size else ""),
            )
        )
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="Training and validation loss")
    ax.grid(alpha=0.3)
    first = ax.legend(
        handles=run_handles,
        fontsize=7,
        title="run",
        title_fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0,
    )
    ax.add_artist(first)
    ax.legend(handles=style_handles, fontsize=7, loc="lower left", bbox_to_anchor=(1.01, 0.0), borderaxespad=0)
    fig.tight_layout()
    return _save(fig, out / "loss_curves.png")


def loss_diff_plot(runs, out: Path) -> Path | None:
    """Training loss of each row minus its reference row's (the baseline, as the tables),
    seed by seed on the steps both logged: one thin line per seed, the mean over the seeds
    both rows have thick; the seeds' min-max bands of the loss plot overlap where the
    paired differences do not."""
    from mta_repro.report.aggregate import group_runs, reference_of

    groups = group_runs([r for r in runs if r.metrics])
    refs = reference_of(groups) if groups else {}
    curves = []
    for g, seeds in groups.items():
        ref = groups[refs[g]]
        if refs[g] == g:
            continue
        per_seed = []
        for s in sorted(set(seeds) & set(ref), key=lambda k: (k is None, k or 0)):
            a, b = dict(loss_series(seeds[s]).get("train", [])), dict(loss_series(ref[s]).get("train", []))
            steps = sorted(set(a) & set(b))
            if steps:
                per_seed.append((s, steps, [a[t] - b[t] for t in steps]))
        if per_seed:
            curves.append((g, refs[g], per_seed))
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for color, (g, ref_g, per_seed) in zip(palette(len(curves)), curves):
        for _, steps, d in per_seed:
            ax.plot(steps, d, color=color, lw=0.6, alpha=0.45)
        common = sorted(set.intersection(*[set(steps) for _, steps, _ in per_seed]))
        mean = [sum(dict(zip(steps, d))[t] for _, steps, d in per_seed) / len(per_seed) for t in common]
        ax.plot(common, mean, color=color, lw=2.0, label=f"{g} - {ref_g} ({len(per_seed)} seeds: thin; mean: thick)")
    ax.axhline(0.0, color="0.4", lw=0.8)
    ax.set(xlabel="step", ylabel="Δ training loss (nats/token)", title="Training loss minus the reference, per seed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return _save(fig, out / "loss_diff.png")


def load_kernels(run: RunData) -> dict:
    """{param name: tensor} of the MTA key-query kernels (H, 1, c_q, c_k) of a run."""
    from mta_repro.eval.load import load_model

    model, _ = load_model(run.path)
    return {
        n: p.detach().float().cpu()
        for n, p in model.named_parameters()
        if n.endswith("mta_kernel") or n.endswith("mta_kernel_after_sm")
    }


def kernel_plot(run: RunData, out: Path, kernels: dict | None = None) -> list:
    """Figure 4 style: one small image per (layer, head), for each kernel kind, as the
    kernel minus the identity it starts from (``identity_kq_kernel``: 1 at the current
    query row and the offset-0 key): on the kernel's own scale the peak of ~1 hides
    off-identity weights of ~0.1, which are what training learned."""
    from mta_repro.model.attention_math import identity_kq_kernel

    kernels = kernels if kernels is not None else load_kernels(run)
    mta_cfg = (((run.config or {}).get("model") or {}).get("mta") or {}) if isinstance(run.config, dict) else {}
    pad_key = str(mta_cfg.get("pad_key") or "both")
    paths = []
    for kind, suffix in (("mta_kernel", "pre-softmax"), ("mta_kernel_after_sm", "post-softmax")):
        ks = sorted(
            ((int(n.split(".")[1]), k) for n, k in kernels.items() if n.endswith("." + kind)), key=lambda x: x[0]
        )
        if not ks:
            continue
        n_heads, _, c_q, c_k = ks[0][1].shape
        ident = identity_kq_kernel(n_heads, c_q, c_k, pad_key)  # (H, 1, c_q, c_k)
        ks = [(layer, k - ident) for layer, k in ks]
        cell = 1.6  # inches per kernel image, wide side
        fig, axes = plt.subplots(
            len(ks),
            n_heads,
            squeeze=False,
            figsize=(cell * n_heads + 1.6, cell * c_q / c_k * len(ks) + 1.2),
        )
        vmax = max(float(k.abs().max()) for _, k in ks) or 1.0
        im = None
        for row, (layer, k) in enumerate(ks):
            for h in range(n_heads):
                ax = axes[row][h]
                im = ax.imshow(k[h, 0].numpy(), cmap="RdBu_r", vmin=-vmax, vmax=vmax, aspect="equal")
                ax.set_xticks([])
                ax.set_yticks([])
                if row == 0:
                    ax.set_title(f"head {h}", fontsize=8)
                if h == 0:
                    ax.set_ylabel(f"layer {layer}", fontsize=8)
        fig.suptitle(
            f"{run.label}: learned {suffix} key-query kernels minus identity\n"
            f"(kernel - identity init; each {c_q}x{c_k}: rows = query offset -{c_q - 1}..0, columns = key offset)",
            fontsize=9,
        )
        fig.subplots_adjust(top=1 - 0.9 / fig.get_figheight(), right=0.85, hspace=0.35, wspace=0.1)
        assert im is not None  # ks holds a kernel of at least one head
        fig.colorbar(im, ax=axes, shrink=0.8, fraction=0.04)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run.label)
        paths.append(_save(fig, out / f"kernels_{safe}_{suffix}.png"))
    return paths
