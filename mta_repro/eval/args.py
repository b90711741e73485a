"""The evaluation config (``configs/eval.yaml``; ``python -m mta_repro.eval``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mta_repro.eval.lm_eval_tasks import LAMBADA, PAPER_FEW_SHOT, PAPER_ZERO_SHOT
from mta_repro.eval.tasks import EVAL_TASKS

# Names accepted in ``tasks=[...]`` and the JSON file each writes under <run_dir>/eval/
# (the registry in mta_repro/eval/tasks.py).
TASK_NAMES = tuple(EVAL_TASKS)


@dataclass
class PplArgs:
    # Window length; null = the context the run was trained at (its data.seq_len: 2048
    # after pretraining, 4096 after the 4K finetune, the length the paper's numbers are
    # compared at, docs/evaluation.md). Each window scores seq_len tokens. Longer than
    # the trained context only with extrapolate=true.
    seq_len: int | None = None
    # Windows per batch and batches per domain at most: 4 and 256, as the release's eval
    # (max_batches * batch_size windows are scored per domain; null = every window).
    batch_size: int = 4
    # null: every window of each domain; 0 or negative is refused (it would score nothing).
    max_batches: int | None = 256
    # Which windows: "random" = a uniform sample without replacement of all the domain's
    # windows, drawn with window_seed; "first" = the first ones of the stream (the
    # release's eval, and this project's before windows were sampled). Random so that the
    # windows represent the domain, not its first documents (docs/evaluation.md).
    window_sampling: str = "random"
    # Seed of the window sample (a non-negative int). A fixed 0, not the run's seed: every
    # run of a study is scored on the same windows, which a paired comparison needs.
    window_seed: int = 0
    # Domains to evaluate; null = every domain of the run's data config.
    domains: list[str] | None = None


@dataclass
class NeedleArgs:
    # Prompt lengths in tokens of the model's tokenizer (2K pretrained, 4K finetuned);
    # at most the trained context unless extrapolate=true.
    context_lens: list[int] = field(default_factory=lambda: [2048])
    needle_counts: list[int] = field(default_factory=lambda: [2, 4, 6, 8, 10])
    depths: list[float] = field(default_factory=lambda: [0, 25, 50, 75, 100])
    # Samples per (context, needle count, depth) setting (paper: 500).
    samples: int = 500
    # "one": ask for one needle's number (others are distractors); "all": every number.
    query: str = "one"
    max_new_tokens: int = 16
    batch_size: int = 8
    # Seed of the prompts (haystack windows, keys, values, the needle asked for); null =
    # the run's own seed (its config's ``seed``, else its provenance record's, else 0 for
    # weights that record none), so that runs of different seeds are asked different
    # prompts and a study's needle samples count prompts, not repeats. The seed used and
    # where it came from are in the JSON (results.settings.seed, seed_source).
    seed: int | None = None
    # Background text: this domain of the run's data config, these splits, in order.
    background_domain: str = "book"
    background_splits: list[str] = field(default_factory=lambda: ["validation", "train"])
    max_background_chars: int = 2_000_000


@dataclass
class BabiLongArgs:
    tasks: list[str] = field(default_factory=lambda: ["qa1", "qa2", "qa3", "qa4", "qa5"])
    # "0k".."16k" (or ints, in tokens of the model's tokenizer); at most the trained
    # context unless extrapolate=true ("0k" = the facts alone).
    lengths: list[str] = field(default_factory=lambda: ["0k", "1k", "2k", "4k"])
    samples: int = 100
    # "generated": offline bAbI-style samples in the background corpus; "hf": the
    # RMT-team/babilong data from the HF hub or its local cache.
    source: str = "generated"
    dataset: str = "RMT-team/babilong"
    max_new_tokens: int = 20
    batch_size: int = 8
    seed: int = 0
    background_domain: str = "book"
    background_splits: list[str] = field(default_factory=lambda: ["validation", "train"])


@dataclass
class LMEvalArgs:
    # The paper's benchmarks (zero-shot unless listed in num_fewshot) and LAMBADA.
    benchmarks: list[str] = field(default_factory=lambda: PAPER_ZERO_SHOT + list(PAPER_FEW_SHOT))
    lambada: list[str] = field(default_factory=lambda: list(LAMBADA))
    num_fewshot: dict[str, int] = field(default_factory=lambda: dict(PAPER_FEW_SHOT))
    batch_size: int = 8
    # Longest context in tokens; null = the run's trained data.seq_len (not the model's
    # max_seqlen: a 2048-token model is not scored at unseen positions). Longer inputs
    # are left-truncated, as lm-eval's HF model does.
    max_length: int | None = None
    # Examples per task (null = all), for quick looks; never for reported numbers.
    limit: int | None = None
    # A directory of extra task YAMLs (e.g. written by lm_eval_tasks.write_local_task).
    include_path: str | None = None


@dataclass
class EvalConfig:
    # Run directory (or consolidated .pt file) to evaluate; the first CLI argument.
    run_dir: str = "runs/debug"
    # Which evaluations to run, any of TASK_NAMES.
    tasks: list[str] = field(default_factory=lambda: ["ppl", "needle", "babilong"])
    # Allow lengths beyond the context the run was trained at (data.seq_len of its
    # config), for length-extrapolation studies; otherwise such a length is refused.
    extrapolate: bool = False
    # Re-evaluate tasks whose JSON is newer than the weights with the same settings
    # (otherwise skipped); ``--force`` on the command line.
    force: bool = False
    # Evaluate although the run config's tokenizer file differs in content (sha256) from
    # the one the weights recorded (refused otherwise); the JSON records the acceptance.
    accept_changed_tokenizer: bool = False
    # Where the JSON results go; null = <run_dir>/eval (also for a run's
    # export/consolidated.pt; a loose .pt file: an eval/ folder next to it).
    out_dir: str | None = None
    # "auto": the GPU (of this process's LOCAL_RANK under torchrun) when there is one,
    # else the CPU; "cpu", "cuda", "cuda:N" force one (a missing GPU is a clear error).
    device: str = "auto"
    # float32 | bfloat16 | float16 | float64
    dtype: str = "float32"
    ppl: PplArgs = field(default_factory=PplArgs)
    needle: NeedleArgs = field(default_factory=NeedleArgs)
    babilong: BabiLongArgs = field(default_factory=BabiLongArgs)
    lm_eval: LMEvalArgs = field(default_factory=LMEvalArgs)


# The counts that must be at least 1 (null allowed where the field says what null means).
POSITIVE = (
    "ppl.seq_len",
    "ppl.batch_size",
    "ppl.max_batches",
    "needle.samples",
    "needle.max_new_tokens",
    "needle.batch_size",
    "babilong.samples",
    "babilong.max_new_tokens",
    "babilong.batch_size",
    "lm_eval.batch_size",
    "lm_eval.max_length",
    "lm_eval.limit",
)
NULLABLE = ("ppl.seq_len", "ppl.max_batches", "lm_eval.max_length", "lm_eval.limit")


def validate(cfg: EvalConfig) -> None:
    """Counts of at least 1 and seeds in range, before any model is loaded: one line naming
    the field (``needle.samples=0`` would divide by zero at the end; ``ppl.max_batches=0``
    would score nothing)."""
    from mta_repro.dataclass_config import check_values
    from mta_repro.errors import UserError

    for key in POSITIVE:
        section, name = key.split(".")
        v = getattr(getattr(cfg, section), name)
        if v is None and key in NULLABLE:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            null = " or null (no limit)" if key in NULLABLE else ""
            raise UserError(f"eval.{key}={v!r}: expected a positive integer{null}")
    check_values(cfg, "eval")


def register_eval_config() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="eval_schema", node=EvalConfig)
