"""The pipeline's plan: stages x variants (+ sweep points) -> jobs with absolute hand-offs.

A pipeline config (``configs/pipeline/<name>.yaml``, the ``pipeline`` node; its fields are
described at ``PIPELINE_KEYS`` below) names variants and stages; ``Plan`` turns them into
one job per training run, evaluation, Appendix I check, Hugging Face import and report,
each with the jobs it needs first, so that the local runner and SLURM run the same plan.

Every run lives at ``<root>/<stage>/<variant>`` (sweeps: ``<root>/<stage>/<point>``, the
point named by the experiment's own run_dir, i.e. by the swept values), given to the
trainer as an absolute ``run_dir=``; hand-offs are absolute ``checkpoint.init_from=``.
With ``seeds: [k, ...]`` every variant or point is one run per seed, at
``<root>/<stage>/<variant|point>/seed<k>``, trained with ``seed=k model.seed=k
data.seed=k``; a stage hands each seed's weights to the same seed of the next stage.

Whether a job is done (its output there and whole): ``mta_repro.pipeline.done``.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from mta_repro.dataclass_config import seed_error
from mta_repro.errors import UserError
from mta_repro.pipeline.done import done, run_differs
from mta_repro.pipeline.job import Job
from mta_repro.train.args import RUN_STAGES, VARIANTS
from mta_repro.train.config import CONFIG_DIR, compose

REPO = CONFIG_DIR.parent
# The fields of a pipeline config:
# - variants: attention variants (baseline, diff, talking_heads, mta).
# - train_overrides: Hydra overrides every training stage gets (e.g. a CPU size).
# - stages: in order, each {name, experiment, variants, init_from, overrides, sweep, eval,
#   check_first_loss, continue_data, seeds, kind}. experiment and overrides may use {variant};
#   experiment may also be a {variant: experiment} map, overrides a {variant: [overrides]}
#   map. init_from names the stage whose run hands its weights over (same variant), or
#   "stage/variant", or "import:<name>" (an imports entry). sweep: true expands the
#   experiment's Hydra sweep (hydra.sweeper.params) into one run per point. eval: overrides
#   of `python -m mta_repro.eval` for this stage's runs (null: not evaluated).
#   check_first_loss: the Appendix I check before training (true, or a list of variants:
#   e.g. [mta], as the control starts from the source unchanged). continue_data: read the
#   training data from where the init_from run stopped (mta_repro.pipeline.data), not from
#   the start of the stream again. seeds: this stage's seeds (default: the pipeline's).
#   kind: what the stage's runs are in the paper's protocol, recorded as run.stage in each
#   run's config and provenance and read by the report: pretrain, long_context, insertion
#   or continued, or a {variant: kind} map (e.g. Appendix I's {mta: insertion, baseline:
#   continued}). Default: the experiment's run.stage, else pretrain for a stage without
#   init_from and insertion for checkpoint.init_mode=baseline_to_mta; any other stage
#   with init_from must say. Every run also gets run.variant and, in a sweep, run.point.
# - seeds: the seeds every variant or sweep point is trained with, e.g. [0, 1, 2]; each
#   seed k is its own run at <root>/<stage>/<variant|point>/seed<k> with seed=k
#   model.seed=k data.seed=k (initialisation, data order and shuffle buffer, dropout).
#   null (the default): one run per variant at <root>/<stage>/<variant> with the
#   experiment's own seeds, as a pipeline without the field always did.
# - lm_eval_local: {task: {split: file}}: lm-eval tasks over local files (written as
#   <task>_local YAMLs under <root>/lm_eval_tasks and put on lm_eval.include_path).
# - imports: {name: local Hugging Face Llama folder} (your own download, e.g. Meta's Llama
#   3.2 1B; nothing is fetched from a hub): one import:<name> job per entry runs
#   `python -m mta_repro.hf import <folder> <root>/imports/<name>/consolidated.pt` (CPU);
#   a stage's init_from: import:<name> starts from that file, and its check_first_loss
#   checks the insertion against it (docs/llama3.md).
# - report (default true): write the report of every evaluated run to <root>/report.
# - contrasts: the comparisons the study is about, named before its results are seen, e.g.
#   [[mta, talking_heads], [mta, baseline]]: each [A, B] (variants or sweep points the plan
#   runs; one whose variant a narrower pipeline.variants leaves out is left out) becomes
#   the report's `--contrast A-B`, tabled as A minus B over the seeds both
#   have, with its interval, n, Holm adjustment over the contrasts and the seeds 80% power
#   needs (mta_repro/report/aggregate.py). null (default): none beyond each row's
#   difference from its reference.
# - appendix_i_tol: the largest first-loss difference, in nats, the check accepts (1e-4).
# - slurm: resources of the evaluation, check and report jobs (training jobs take
#   their experiment's); its partition, account, qos and constraint go to every job.
# - name: the pipeline's name.
STAGE_KEYS = {
    "name",
    "experiment",
    "variants",
    "init_from",
    "overrides",
    "sweep",
    "eval",
    "check_first_loss",
    "continue_data",
    "seeds",
    "kind",
}
PIPELINE_KEYS = {
    "name",
    "variants",
    "train_overrides",
    "stages",
    "lm_eval_local",
    "report",
    "appendix_i_tol",
    "slurm",
    "imports",
    "seeds",
    "contrasts",
}
IMPORT_PREFIX = "import:"  # init_from: import:<name> = the imports entry <name>
CONTINUE_LOADER = "mta_repro.pipeline.data:build_continued_loader"
SEED_PREFIX = "seed"  # a seeded run's directory: seed<k>


def seed_overrides(seed: int) -> list:
    """The training overrides of seed ``seed``: every random stream of a run
    (``seed``: dropout and anything else stochastic; ``model.seed``: initialisation;
    ``data.seed``: document order, domain draws and the shuffle buffer)."""
    return [f"seed={seed}", f"model.seed={seed}", f"data.seed={seed}"]


def _seeds(node, where: str) -> list | None:
    """A ``seeds`` field: None, or a non-empty list of distinct non-negative ints."""
    if node is None:
        return None
    if not isinstance(node, (list, tuple, ListConfig)) or not node:
        raise UserError(f"{where}: expected a non-empty list of seeds (e.g. [0, 1, 2]) or null, got {node!r}")
    out = []
    for x in node:
        if seed_error(x, where):
            raise UserError(f"{where}: {x!r} is not a seed; expected integers 0 <= seed < 2**32, e.g. [0, 1, 2]")
        out.append(int(x))
    if len(set(out)) != len(out):
        raise UserError(f"{where}: {out} names a seed twice; each seed is one run")
    return out


def _contrasts(node) -> list:
    """A ``contrasts`` field: None, or a list of [A, B] pairs of distinct names (no "-":
    the report's ``--contrast A-B``)."""
    if node is None:
        return []
    if not isinstance(node, (list, tuple, ListConfig)):
        raise UserError(f"pipeline.contrasts: expected a list of [A, B] pairs or null, got {node!r}")
    out = []
    for i, pair in enumerate(node):
        ok = isinstance(pair, (list, tuple, ListConfig)) and len(pair) == 2
        names = [str(x) for x in pair] if ok else []
        if not ok or names[0] == names[1] or any(not n or "-" in n for n in names):
            raise UserError(
                f"pipeline.contrasts[{i}]: expected [A, B], two different variant or point names without '-' "
                f"(e.g. [mta, talking_heads]), got {pair!r}"
            )
        out.append((names[0], names[1]))
    return out


def _list(node, where: str) -> list:
    if node is None:
        return []
    if isinstance(node, (list, tuple, ListConfig)):
        return [str(x) for x in node]
    raise UserError(f"{where}: expected a list, got {node!r}")


def _fmt(s: str, variant: str, where: str) -> str:
    try:
        return s.replace("{variant}", variant)
    except AttributeError:
        raise UserError(f"{where}: expected a string, got {s!r}") from None


def _experiment(stage: dict, variant: str, where: str) -> str:
    exp = stage.get("experiment")
    if exp is None:
        raise UserError(f"{where}.experiment: required (a configs/experiment name, may use {{variant}})")
    if isinstance(exp, (dict, DictConfig)):
        if variant not in exp:
            raise UserError(f"{where}.experiment: no experiment for variant {variant!r} (has {sorted(exp)})")
        return str(exp[variant])
    return _fmt(str(exp), variant, f"{where}.experiment")


class Compositions:
    """The plan's configs, each composed by ``mta_repro.train.config.compose`` (the one
    composition); eval's are cached by their overrides (every run of a stage shares them)."""

    def __init__(self) -> None:
        from mta_repro.eval.args import register_eval_config

        register_eval_config()
        self._evals: dict = {}

    def train(self, overrides) -> DictConfig:
        return compose(list(overrides))

    def eval(self, overrides):
        """(tasks, out_dir) of ``python -m mta_repro.eval <run> <overrides>``."""
        key = tuple(overrides)
        if key not in self._evals:
            from mta_repro.eval.args import EvalConfig

            cfg = OmegaConf.to_object(compose(list(overrides), config_name="eval"))
            assert isinstance(cfg, EvalConfig)
            self._evals[key] = (list(cfg.tasks), cfg.out_dir)
        return self._evals[key]


def sweep_points(experiment: str) -> list:
    """[(point overrides)] of a sweep experiment's ``hydra.sweeper.params`` (in order)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    path = CONFIG_DIR / "experiment" / f"{experiment}.yaml"
    if not path.is_file():
        raise UserError(f"experiment={experiment}: no {path}")
    raw = OmegaConf.load(path)
    params = OmegaConf.select(raw, "hydra.sweeper.params")
    if not params:
        raise UserError(f"experiment={experiment}: sweep: true but it has no hydra.sweeper.params")
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] for o in parsed]
    return [list(c) for c in itertools.product(*axes)]


def _overrides(stage, variant: str, where: str) -> list:
    """A stage's ``overrides``: a list (may use {variant}), or a {variant: list} map."""
    ov = stage.get("overrides")
    if isinstance(ov, (dict, DictConfig)):
        return _list(ov.get(variant), f"{where}.overrides.{variant}")
    return _list(ov, f"{where}.overrides")


def _checks(stage, variant: str, where: str) -> bool:
    """Whether ``check_first_loss`` (true/false or a list of variants) asks for this variant's check."""
    v = stage.get("check_first_loss")
    if isinstance(v, (list, tuple, ListConfig)):
        return variant in [str(x) for x in v]
    if v is None or isinstance(v, bool):
        return bool(v)
    raise UserError(f"{where}.check_first_loss: expected true/false or a list of variants, got {v!r}")


def _kind(stage, variant: str, cfg: DictConfig, where: str) -> str:
    """The ``run.stage`` of a stage's run of ``variant`` (``kind`` in PIPELINE_KEYS' notes);
    ``cfg`` is the run's composed config."""
    node = stage.get("kind")
    if isinstance(node, (dict, DictConfig)):
        node, where = node.get(variant), f"{where}.kind.{variant}"
    else:
        where = f"{where}.kind"
    if node is None:
        node = OmegaConf.select(cfg, "run.stage")  # the experiment's own, or an override's
    if node is None and stage.get("init_from") is None:
        node = "pretrain"
    if node is None and OmegaConf.select(cfg, "checkpoint.init_mode") == "baseline_to_mta":
        node = "insertion"
    if node is None:
        raise UserError(
            f"{where}: required for a run of {variant} that starts from init_from "
            f"{stage.get('init_from')!r} (the report places the run by it); expected one of "
            f"{list(RUN_STAGES)}: long_context for a longer context or a RoPE change, continued for "
            "training on as it was (e.g. Appendix I's control), or a {variant: kind} map"
        )
    if node not in RUN_STAGES:
        raise UserError(f"{where}: {node!r} is not a stage of the protocol; expected one of {list(RUN_STAGES)}")
    return str(node)


def _safe_name(name: str) -> str:
    """A directory name that needs no quoting in a Hydra override (``2,6,10`` -> ``2-6-10``)."""
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in name)


def _point_value(o: str) -> str:
    """``model.mta.mta_layers=${...}`` as a command-line override: quote the value so that
    Hydra reads commas and interpolations as one string."""
    key, _, val = o.partition("=")
    if any(c in val for c in ",$[]{}()'\" "):
        return f"{key}='" + val.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return o


def _resolved(cfg: DictConfig) -> dict | None:
    """A composed training config as the trainer records it in config.yaml (resolved); None
    when it cannot be resolved here (the done check then compares nothing)."""
    try:
        out = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - e.g. an env interpolation only the job's node has
        return None
    return out if isinstance(out, dict) else None


class Plan:
    def __init__(
        self,
        spec: DictConfig,
        root: Path,
        python: str = sys.executable,
        jobs: list[Job] | None = None,
        train_dirs: dict[str, Path] | None = None,
    ):
        """The plan of a pipeline config (``spec``: the ``pipeline`` node), or, with ``jobs``
        (and their ``train_dirs``), a plan already made (a ``-m`` sweep's:
        ``mta_repro.pipeline.sweep``) that the same runner runs."""
        self.spec = spec
        self.root = Path(root).expanduser().resolve()
        self.python = python
        self.jobs: list[Job] = list(jobs or [])
        self.train_dirs: dict[str, Path] = dict(train_dirs or {})  # "<stage>/<variant|point>" -> run dir
        if jobs is None:
            self._build()

    # ------------------------------------------------------------------ building
    def _validate(self) -> None:
        s = self.spec
        extra = set(s) - PIPELINE_KEYS
        if extra:
            raise UserError(f"pipeline: unknown field(s) {sorted(extra)}; expected {sorted(PIPELINE_KEYS)}")
        for v in _list(s.get("variants"), "pipeline.variants"):
            if v not in VARIANTS:
                raise UserError(f"pipeline.variants: unknown variant {v!r}; expected any of {list(VARIANTS)}")
        if not s.get("stages"):
            raise UserError("pipeline.stages: empty; expected a list of stages")
        _seeds(s.get("seeds"), "pipeline.seeds")
        _contrasts(s.get("contrasts"))
        imports = self._imports()
        names = []
        for i, st in enumerate(s.stages):
            where = f"pipeline.stages[{i}]"
            extra = set(st) - STAGE_KEYS
            if extra:
                raise UserError(f"{where}: unknown field(s) {sorted(extra)}; expected {sorted(STAGE_KEYS)}")
            if not st.get("name"):
                raise UserError(f"{where}.name: required")
            if st.name in names:
                raise UserError(f"{where}.name: {st.name!r} appears twice")
            if st.get("experiment") is None:
                raise UserError(f"{where}.experiment: required (a configs/experiment name, may use {{variant}})")
            src = st.get("init_from")
            imported = src is not None and str(src).startswith(IMPORT_PREFIX)
            if imported and str(src)[len(IMPORT_PREFIX) :] not in imports:
                raise UserError(
                    f"{where}.init_from: {src!r}: no such entry in pipeline.imports (has {sorted(imports)})"
                )
            if src is not None and not imported and str(src).split("/")[0] not in names:
                raise UserError(
                    f"{where}.init_from: {src!r} is not an earlier stage (earlier: {names})"
                    + (f" nor import:<name> of pipeline.imports ({sorted(imports)})" if imports else "")
                )
            _seeds(st.get("seeds"), f"{where}.seeds")
            if st.get("check_first_loss") and src is None:
                raise UserError(f"{where}.check_first_loss: needs init_from (the source model)")
            if st.get("continue_data") and (src is None or imported):
                raise UserError(
                    f"{where}.continue_data: needs init_from of an earlier stage (the run whose data "
                    "position it continues)"
                )
            names.append(st.name)

    def _imports(self) -> dict:
        """{name: absolute folder} of ``pipeline.imports``."""
        node = self.spec.get("imports")
        if node is None:
            return {}
        if not isinstance(node, (dict, DictConfig)):
            raise UserError(f"pipeline.imports: expected a map {{name: local Hugging Face folder}}, got {node!r}")
        out = {}
        for name, folder in node.items():
            if _safe_name(str(name)) != str(name) or not str(name):
                raise UserError(f"pipeline.imports: {name!r}: a name of letters, digits, '.', '_', '-' expected")
            if not isinstance(folder, (str, Path)) or not str(folder):
                raise UserError(
                    f"pipeline.imports.{name}: expected the path of a local Hugging Face model folder "
                    f"(config.json + safetensors), got {folder!r}"
                )
            out[str(name)] = Path(str(folder)).expanduser().resolve()
        return out

    def _build(self) -> None:
        self._validate()
        self._build_jobs(Compositions())

    def _build_jobs(self, c: Compositions) -> None:
        s = self.spec
        common = _list(s.get("train_overrides"), "pipeline.train_overrides")
        pipeline_variants = _list(s.get("variants"), "pipeline.variants")
        include = self._lm_eval_include()
        evals = []
        imported: dict[str, Path] = {}  # import name -> the .pt its job writes
        for name, folder in self._imports().items():
            out = self.root / "imports" / name / "consolidated.pt"
            imported[name] = out
            self.jobs.append(
                Job(
                    f"{IMPORT_PREFIX}{name}",
                    "import",
                    out.parent,
                    [self.python, "-m", "mta_repro.hf", "import", str(folder), str(out)],
                    [],
                    "imports",
                    name,
                    hf_dir=folder,
                    out_file=out,
                )
            )
        for i, st in enumerate(s.stages):
            where = f"pipeline.stages[{i}]"
            variants = _list(st.get("variants"), f"{where}.variants") or pipeline_variants
            for variant in variants:
                exp = _experiment(st, variant, where)
                base = (
                    [f"experiment={exp}"]
                    + common
                    + [_fmt(o, variant, f"{where}.overrides") for o in _overrides(st, variant, where)]
                )
                points = [(variant, [])]
                if st.get("sweep"):
                    points = []
                    for pt in sweep_points(exp):
                        cfg = c.train(base + pt)
                        # the swept values as this config resolves them (e.g. the layer list
                        # for this model's depth), so the job's command line says what it runs
                        concrete = [f"{o.partition('=')[0]}={OmegaConf.select(cfg, o.partition('=')[0])}" for o in pt]
                        points.append((_safe_name(Path(str(cfg.run_dir)).name), concrete))
                    names = [p for p, _ in points]
                    if len(set(names)) != len(names):
                        raise UserError(
                            f"{where}: experiment={exp} names two sweep points alike ({names}); "
                            "its run_dir must contain every swept value"
                        )
                stage_seeds = _seeds(st.get("seeds"), f"{where}.seeds") or _seeds(s.get("seeds"), "pipeline.seeds")
                for (point, pt), seed in itertools.product(points, stage_seeds or [None]):
                    label = f"{st.name}/{point}" + ("" if seed is None else f"/{SEED_PREFIX}{seed}")
                    if label in self.train_dirs:
                        raise UserError(f"{where}: run {label} planned twice")
                    run_dir = self.root / label
                    ov = base + [_point_value(o) for o in pt] + ([] if seed is None else seed_overrides(seed))
                    if st.get("sweep"):
                        ov.append("hydra.mode=RUN")  # one point per job, not the experiment's multirun
                    deps = []
                    src_dir = None
                    if st.get("init_from") is not None and str(st.init_from).startswith(IMPORT_PREFIX):
                        src_dir = imported[str(st.init_from)[len(IMPORT_PREFIX) :]]
                        ov.append(f"checkpoint.init_from={src_dir}")
                        deps.append(str(st.init_from))
                    elif st.get("init_from") is not None:
                        src = str(st.init_from)
                        src_label = src if "/" in src else f"{src}/{variant}"
                        if seed is not None and f"{src_label}/{SEED_PREFIX}{seed}" in self.train_dirs:
                            src_label = f"{src_label}/{SEED_PREFIX}{seed}"  # each seed from the same seed
                        if src_label not in self.train_dirs:
                            raise UserError(
                                f"{where}.init_from: {src!r}: no run {src_label} in the plan "
                                f"(planned: {sorted(self.train_dirs)})"
                            )
                        src_dir = self.train_dirs[src_label]
                        ov.append(f"checkpoint.init_from={src_dir}")
                        deps.append(f"train:{src_label}")
                    if st.get("continue_data"):
                        ov.append(f"trainer.loader={CONTINUE_LOADER}")
                    ov.append(f"run_dir={run_dir}")
                    # a typo or a missing field fails here, before any job
                    cfg = c.train(ov)
                    for key in ("seed", "model.seed", "data.seed"):  # before any job, as training would
                        bad = seed_error(OmegaConf.select(cfg, key), key)
                        if bad:
                            raise UserError(f"{where}: {bad}")
                    # what the run is, in its config and provenance: the report reads it
                    ov += [f"run.stage={_kind(st, variant, cfg, where)}", f"run.variant={variant}"]
                    if st.get("sweep"):
                        ov.append(f"run.point={point}")
                    self.train_dirs[label] = run_dir
                    if _checks(st, variant, where):
                        tol = float(s.get("appendix_i_tol", 1e-4))
                        self.jobs.append(
                            Job(
                                f"check:{label}",
                                "check",
                                run_dir,
                                [self.python, "-m", "mta_repro.pipeline.check", *ov, f"--tol={tol}"],
                                list(deps),
                                st.name,
                                label,
                                ov,
                            )
                        )
                        deps = deps + [f"check:{label}"]
                    self.jobs.append(
                        Job(
                            f"train:{label}",
                            "train",
                            run_dir,
                            [self.python, "-m", "mta_repro.train", *ov],
                            deps,
                            st.name,
                            label,
                            ov,
                            steps=int(cfg.trainer.steps),
                            config=_resolved(cfg),
                        )
                    )
                    if st.get("eval") is not None:
                        evals.append((st, label, run_dir, _list(st.eval, f"{where}.eval")))
        steps = {j.label: j.steps for j in self.jobs if j.kind == "train"}
        configs = {j.label: j.config for j in self.jobs if j.kind == "train"}
        for st, label, run_dir, ev in evals:  # all training first: the eval jobs never delay a stage
            ov = list(ev) + ([f"lm_eval.include_path={include}"] if include else [])
            tasks, out_dir = c.eval(ov)
            out = Path(out_dir) if out_dir else run_dir / "eval"
            self.jobs.append(
                Job(
                    f"eval:{label}",
                    "eval",
                    run_dir,
                    [self.python, "-m", "mta_repro.eval", str(run_dir), *ov],
                    [f"train:{label}"],
                    st.name,
                    label,
                    steps=steps[label],
                    eval_tasks=tasks,
                    eval_out=out,
                    config=configs[label],
                )
            )
        if s.get("report", True):
            runs = list(self.train_dirs.items())
            out = self.root / "report"
            cmd = [self.python, "-m", "mta_repro.report", *[str(d) for _, d in runs], "--out", str(out)]
            for label, d in runs:
                cmd += ["--label", f"{d}={label}"]
            ran = {label.split("/")[1] for label in self.train_dirs if "/" in label}
            for a, b in _contrasts(s.get("contrasts")):
                unknown = [n for n in (a, b) if n not in ran and n not in VARIANTS]
                if unknown:
                    raise UserError(
                        f"pipeline.contrasts: {a}-{b} names {unknown[0]!r}, which is no variant and no point "
                        f"this plan runs; expected any of {sorted(ran | set(VARIANTS))}"
                    )
                if a in ran and b in ran:  # a variant left out (pipeline.variants=[...]): its contrasts too
                    cmd += ["--contrast", f"{a}-{b}"]
            self.jobs.append(
                Job(
                    "report",
                    "report",
                    out,
                    cmd,
                    [j.id for j in self.jobs],
                    "report",
                    "report",
                    runs=[d for _, d in runs],
                )
            )

    def _lm_eval_include(self) -> Path | None:
        local = self.spec.get("lm_eval_local")
        return (self.root / "lm_eval_tasks") if local else None

    def write_lm_eval_tasks(self) -> Path | None:
        """Write the ``<task>_local`` YAMLs (needs lm-eval's task index: a few seconds)."""
        local = self.spec.get("lm_eval_local")
        if not local:
            return None
        from mta_repro.data.args import resolve_path
        from mta_repro.eval.lm_eval_tasks import task_manager, write_local_task

        out = self._lm_eval_include()
        manager = task_manager()
        for task, files in local.items():
            paths = {}
            for split, p in files.items():
                f = resolve_path(str(p))
                if not f.is_file():
                    raise UserError(f"pipeline.lm_eval_local.{task}.{split}: {p} does not exist")
                paths[str(split)] = f
            write_local_task(str(task), paths, out, manager=manager)
        return out

    # ------------------------------------------------------------------ state
    def job(self, job_id: str) -> Job:
        return next(j for j in self.jobs if j.id == job_id)

    def is_done(self, job: Job) -> bool:
        return done(job)

    def describe(self) -> str:
        w = max(len(j.id) for j in self.jobs)
        lines = [f"pipeline {self.spec.get('name', '?')}: {len(self.jobs)} jobs under {self.root}"]
        for j in self.jobs:
            # differs: the run dir holds another run than the plan's; the runner refuses it
            state = "done" if done(j) else ("differs" if run_differs(j) else "todo")
            after = (
                f" after {', '.join(j.deps)}"
                if j.deps and j.kind != "report"
                else (" after all" if j.kind == "report" else "")
            )
            lines.append(f"  [{state}] {j.id:<{w}}  {j.run_dir}{after}")
        return "\n".join(lines)
