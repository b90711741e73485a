"""Results table (CSV + Markdown) and the held-out error plot of the toy task."""

from __future__ import annotations

import csv
from pathlib import Path
from statistics import mean

COLUMNS = ("model", "seed", "seq_error", "token_error")


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow([r["model"], r["seed"], f"{r['seq_error']:.2f}", f"{r['token_error']:.2f}"])


def markdown_table(rows: list[dict], title: str = "", notes: list[str] | None = None) -> str:
    """Per model: one line per seed, then the mean over seeds (errors in %)."""
    out = [f"# {title}", ""] if title else []
    out += ["| model | seed | sequence error (%) | token error (%) |", "|---|---|---|---|"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    for m in models:
        mine = [r for r in rows if r["model"] == m]
        for r in mine:
            out.append(f"| {m} | {r['seed']} | {r['seq_error']:.1f} | {r['token_error']:.2f} |")
        out.append(
            f"| **{m}** | **mean** | **{mean(r['seq_error'] for r in mine):.1f}** | "
            f"**{mean(r['token_error'] for r in mine):.2f}** |"
        )
    if notes:
        out += [""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def plot_curves(results: list[dict], path: Path, title: str = "") -> None:
    """Held-out sequence and token error over training, one line per (model, seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"baseline": "tab:blue", "mta": "tab:red"}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, ax, label in (
        (("seq_error"), axes[0], "sequence error (%)"),
        (("token_error"), axes[1], "token error (%)"),
    ):
        seeds = sorted({r["seed"] for r in results})
        for r in results:
            steps = [c["step"] for c in r["curve"]]
            vals = [c[key] for c in r["curve"]]
            ax.plot(
                steps,
                vals,
                color=colors.get(r["model"], "k"),
                linestyle=styles[seeds.index(r["seed"]) % len(styles)],
                label=f"{'Transformer' if r['model'] == 'baseline' else 'MTA'} seed {r['seed']}",
            )
        ax.set_xlabel("training step")
        ax.set_ylabel(f"held-out {label}")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
