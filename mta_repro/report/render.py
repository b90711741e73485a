"""A report table and its renderings: Markdown (with the provenance block under it), CSV,
LaTeX and the JSON of ``results.json``. What goes in the rows is the table builders' work
(``mta_repro.report.tables``)."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field


@dataclass
class Table:
    name: str  # file stem
    title: str
    headers: list
    rows: list  # lists of str | float | None
    notes: list = field(default_factory=list)
    # What each row's numbers came from: {run label: {"checkpoint", ..., "comparable"}}
    # (``add_provenance``), rendered as a block under the table.
    provenance: dict = field(default_factory=dict)
    digits: int = 2  # decimals of a float cell (a loss in nats needs 4)

    def cell(self, v, blank="—") -> str:
        if v is None:
            return blank
        if isinstance(v, float):
            return f"{v:.{self.digits}f}"
        return str(v)

    def markdown(self) -> str:
        out = [
            f"### {self.title}",
            "",
            "| " + " | ".join(self.headers) + " |",
            "|" + "|".join("---" for _ in self.headers) + "|",
        ]
        out += ["| " + " | ".join(self.cell(v) for v in row) + " |" for row in self.rows]
        if self.notes:
            out += [""] + [f"- {n}" for n in self.notes]
        if self.provenance:
            cols = ["stage", "checkpoint", "tokens seen", "tokenizer", "data", "code", "comparable", "seed"]
            cols = [c for c in cols if any(c in p for p in self.provenance.values())]
            out += [
                "",
                f"Provenance of the {self.name} rows (docs/provenance.md):",
                "",
                "| run | " + " | ".join(cols) + " |",
                "|---" * (len(cols) + 1) + "|",
            ]
            out += [
                "| " + " | ".join([label] + [str(p.get(c, "—")) for c in cols]) + " |"
                for label, p in self.provenance.items()
            ]
        return "\n".join(out) + "\n"

    def csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(self.headers)
        for row in self.rows:
            w.writerow(["" if v is None else (f"{v:.4f}" if isinstance(v, float) else v) for v in row])
        return buf.getvalue()

    def latex(self) -> str:
        esc = lambda s: (
            str(s).replace("\\", "\\textbackslash{}").replace("_", "\\_").replace("%", "\\%").replace("&", "\\&")
        )  # noqa: E731
        lines = [
            "\\begin{table}[t]",
            "\\centering",
            f"\\caption{{{esc(self.title)}}}",
            "\\begin{tabular}{l" + "r" * (len(self.headers) - 1) + "}",
            "\\toprule",
            " & ".join(esc(h) for h in self.headers) + " \\\\",
            "\\midrule",
        ]
        lines += [" & ".join(esc(self.cell(v, "--")) for v in row) + " \\\\" for row in self.rows]
        lines += ["\\bottomrule", "\\end{tabular}"]
        lines += [f"\\par\\footnotesize {esc(n)}" for n in self.notes]
        lines += ["\\end{table}"]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return {
            "title": self.title,
            "headers": self.headers,
            "rows": [dict(zip(self.headers, row)) for row in self.rows],
            "notes": self.notes,
            "provenance": self.provenance,
        }
