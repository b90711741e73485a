"""A job of a pipeline's plan: one training run, evaluation, Appendix I check, Hugging
Face import or report, with the jobs it needs first (``mta_repro.pipeline.plan`` makes
them; ``mta_repro.pipeline.done`` says whether one is done)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    id: str  # "train:pretrain/mta", "eval:pretrain/mta", "check:insertion/mta", "import:llama3_2_1b", "report"
    kind: str  # train | eval | check | import | report
    run_dir: Path  # the run (report: the report's output directory)
    command: list  # argv
    deps: list = field(default_factory=list)  # job ids
    stage: str = ""
    label: str = ""  # "<stage>/<variant or point>", + "/seed<k>" with seeds
    overrides: list = field(default_factory=list)  # train / check: the training overrides
    steps: int | None = None  # train: trainer.steps
    eval_tasks: list = field(default_factory=list)  # eval: task names
    eval_out: Path | None = None  # eval: where the JSONs go
    runs: list = field(default_factory=list)  # report: run dirs
    hf_dir: Path | None = None  # import: the local Hugging Face folder read
    out_file: Path | None = None  # import: the consolidated .pt written
    # train, eval: the resolved training config the plan asks for (what the run's config.yaml
    # must hold for the run to be this job's: ``mta_repro.pipeline.done.run_differs``)
    config: dict | None = None

    def shell(self) -> str:
        return " ".join(shlex.quote(str(a)) for a in self.command)
