"""Config sections of the trainer (root config fields ``trainer``, ``checkpoint``,
``logging``, ``distributed``, ``slurm``, ``run``; ``optim`` lives in ``mta_repro.train.optim``).

Each is a dataclass registered through ``mta_repro.train.config.TrainConfig``, so a typo in an
override (``trainer.stpes=10``) fails when Hydra composes the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from mta_repro.errors import UserError
from mta_repro.estimate.cpu_malloc import check_threshold

NONFINITE_CHOICES = ("raise", "skip")
ON_CORRUPT_CHOICES = ("fallback", "raise")
INIT_MODES = ("model", "baseline_to_mta")
WANDB_MODES = ("offline", "online", "disabled")
TIMEOUT_MAX_MIN = 365 * 24 * 60
# The stages of the paper's protocol a run can be (``run.stage``) and the attention
# variants it compares (``run.variant``: the configs/attention options).
RUN_STAGES = ("pretrain", "long_context", "insertion", "continued")
VARIANTS = ("baseline", "diff", "talking_heads", "mta")


@dataclass
class RunArgs:
    """What a run is in the paper's protocol (root config ``run``), recorded so that the
    report places it by what it is rather than by what its config looks like. The pipeline
    sets all three for every run it plans; a run started by hand has null (unrecorded)
    unless given, and the report then infers its stage from its config (and says so)."""

    # Labels, not inputs: they change nothing the run computes, so a resume may change them
    # (and a run started before they existed resumes with them set).
    RUN_DIR: ClassVar[str] = "free"
    # pretrain (from scratch), long_context (the 4K finetune: a longer context or a RoPE
    # change), insertion (Appendix I: MTA inserted into a trained baseline) or continued
    # (trained on as it was, e.g. Appendix I's control); null: unrecorded.
    stage: str | None = None
    # The attention variant: baseline, diff, talking_heads or mta; null: unrecorded (the
    # report then takes the variant of the model config).
    variant: str | None = None
    # The sweep point of a Table 5 sweep (the pipeline's name for it, e.g.
    # kernel_4x7); null for a run that is no sweep point.
    point: str | None = None

    def __post_init__(self) -> None:
        if self.stage is not None and self.stage not in RUN_STAGES:
            raise UserError(f"run.stage: expected one of {RUN_STAGES} or null (unrecorded), got {self.stage!r}")
        if self.variant is not None and self.variant not in VARIANTS:
            raise UserError(f"run.variant: expected one of {VARIANTS} or null (unrecorded), got {self.variant!r}")


@dataclass
class TrainerArgs:
    """The loop (group ``configs/trainer``)."""

    # Optimiser updates to run in total (the schedule decays to 0 at this step).
    steps: int = field(default=1000, metadata={"run_dir": "safe"})
    # Micro-batches per update; the global batch is
    # data.batch_size * data.seq_len * world_size * grad_accum tokens.
    grad_accum: int = field(default=1, metadata={"run_dir": "free"})
    # "auto" = cuda if available else cpu; or "cpu" / "cuda".
    device: str = field(default="auto", metadata={"run_dir": "safe"})
    # What to do when the loss is NaN/inf: "raise" stops with an error (the last good
    # checkpoint stays the latest; found at the next read, every logging.every steps and
    # before any save), "skip" drops that update and goes on (it reads the loss every step:
    # a host sync per step).
    nonfinite: str = field(default="raise", metadata={"run_dir": "safe"})
    # "module:function" building the per-rank batch iterator as
    # fn(data_args, rank, world_size) (the data contract: dict input/target, state_dict).
    loader: str = "mta_repro.data:build_train_loader"
    # Validation: per-domain loss/ppl on the data's validation split every this many
    # steps and always at the last step (the protocol of `mta_repro.eval`'s ppl:
    # mta_repro/eval/ppl.py); 0 = never. Logged as val_* keys to metrics.jsonl and wandb.
    eval_every: int = field(default=1000, metadata={"run_dir": "safe"})
    # Per domain: at most this many batches of eval_batch_size windows of data.seq_len
    # tokens (the eval's defaults: 256 x 4 windows = 2M tokens at seq_len 2048).
    eval_max_batches: int = field(default=256, metadata={"run_dir": "safe"})
    eval_batch_size: int = field(default=4, metadata={"run_dir": "safe"})
    # The training loss in chunks of this many token rows (of data.batch_size * data.seq_len):
    # each chunk's logits (rows, vocab) are computed from the final hidden states and
    # recomputed in backward, so no (B, T, vocab) logits, log-softmax or gradient is held
    # (at 880M with Llama 3's 128K vocabulary the plain loss is 12.6 of the 27.2 GB per GPU;
    # docs/memory.md). The same loss and gradients as the plain one up to fp32 rounding, for
    # one more (rows, dim) x (dim, vocab) matmul per chunk in backward. 0 = the plain loss,
    # as the paper trains (mta_repro/model/loss.py).
    loss_chunk: int = field(default=0, metadata={"run_dir": "safe"})
    # CPU only: fix glibc's mmap threshold at this many bytes before the model is built,
    # so that peak resident memory stays at what the tensors need (the memory pre-flight's
    # estimate) instead of glibc's dynamic heap, which keeps freed tensors resident; it
    # costs step time (every such tensor is a fresh mmap). null = glibc's default (fastest).
    # 131072 is glibc's initial value (mta_repro/estimate/cpu_malloc.py; both effects measured
    # in docs/memory.md).
    cpu_mmap_threshold: int | None = field(default=None, metadata={"run_dir": "free"})
    # Before anything is allocated, refuse in one line a model, batch and world size whose
    # memory on one rank is over the device's (GPU: free memory; CPU: the memory available,
    # shared by the node's ranks): a floor (fp32 parameters and AdamW moments, one fp32 copy
    # of the logits), then the memory pre-flight (mta_repro/estimate/memory.py) on a GPU or
    # when the floor is over 5% of it (mta_repro/estimate/memory_check.py). false = start anyway.
    memory_check: bool = field(default=True, metadata={"run_dir": "free"})

    def __post_init__(self) -> None:
        if isinstance(self.loss_chunk, bool) or not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise UserError(
                f"trainer.loss_chunk: expected an integer >= 0 (token rows per chunk; 0 = the plain loss), "
                f"got {self.loss_chunk!r}"
            )
        if self.eval_every < 0:
            raise UserError(f"trainer.eval_every: expected >= 0 (0 = no validation), got {self.eval_every}")
        if self.eval_max_batches < 1 or self.eval_batch_size < 1:
            raise UserError(
                f"trainer.eval_max_batches / eval_batch_size: expected >= 1, got "
                f"{self.eval_max_batches} / {self.eval_batch_size}"
            )
        if self.steps < 1:
            raise UserError(f"trainer.steps: expected >= 1, got {self.steps}")
        if self.grad_accum < 1:
            raise UserError(f"trainer.grad_accum: expected >= 1, got {self.grad_accum}")
        if self.nonfinite not in NONFINITE_CHOICES:
            raise UserError(f"trainer.nonfinite: expected one of {NONFINITE_CHOICES}, got {self.nonfinite!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UserError(f"trainer.device: expected auto, cpu or cuda, got {self.device!r}")
        check_threshold(self.cpu_mmap_threshold)


@dataclass
class CheckpointArgs:
    """Checkpoints, resume and stage initialisation (group ``configs/checkpoint``)."""

    # Save every this many steps (and always at the last step and on preemption).
    every: int = field(default=1000, metadata={"run_dir": "safe"})
    # Keep the newest K complete checkpoints; older ones are deleted.
    keep: int = field(default=3, metadata={"run_dir": "safe"})
    # Start from the latest complete checkpoint in <run_dir>/checkpoints if any.
    resume: bool = field(default=True, metadata={"run_dir": "free"})
    # Stage start (used only when there is nothing to resume): a run dir, a DCP
    # checkpoint dir or a consolidated .pt whose *model* weights initialise this run
    # (fresh optimizer, schedule and data). None = the seeded init.
    init_from: str | None = field(default=None, metadata={"run_dir": "safe", "path": True})
    # "model": load the weights as they are (long-context finetuning);
    # "baseline_to_mta": a baseline's weights into this MTA model, new parts at identity
    # (Appendix I).
    init_mode: str = "model"
    # Write <run_dir>/export/consolidated.pt when training finishes.
    export: bool = field(default=True, metadata={"run_dir": "safe"})
    # Restarting in a run dir whose saved config.yaml differs only in fields that do not
    # change the model, data or optimiser state (trainer.steps, logging, checkpoint
    # cadence, distributed/performance settings) is refused unless this is true. Model,
    # data and optimiser fields can never change within a run dir
    # (each field's class is its metadata "run_dir"; mta_repro/train/config_check.py).
    allow_config_change: bool = field(default=False, metadata={"run_dir": "free"})
    # The latest checkpoint cannot be read (e.g. a truncated .distcp): "fallback" loads the
    # newest earlier complete one with a warning, "raise" stops with the error.
    on_corrupt: str = field(default="fallback", metadata={"run_dir": "free"})
    # Save with DCP's async_save: the step loop goes on while a background thread writes
    # the files; the checkpoint is marked complete and renamed only after the write
    # finished (the same atomicity as a plain save). CPU memory holds one staged copy.
    async_save: bool = field(default=False, metadata={"run_dir": "free"})
    # "module:function" called as fn(event, step, path) at the two moments of a save that a
    # kill can tear: "written" (this rank's files of `step` are on disk in the temporary
    # folder `path`, not yet marked complete) and "async_writing" (an async save's
    # background write of `path` has begun). For tests that inject faults there
    # (tests/fixtures/faults/faults.py) and for instrumentation; nothing a run's numbers depend on.
    save_hook: str | None = field(default=None, metadata={"run_dir": "free"})
    # A resume (or a start from init_from's data position) checks that the text the run
    # already read of its data files is unchanged, and refuses one whose bytes changed,
    # naming the file; true goes on with the files as they are now (docs/provenance.md).
    # An accepted change is recorded in <run_dir>/provenance.json.
    accept_changed_data: bool = field(default=False, metadata={"run_dir": "free"})
    # A resume, and a stage start from checkpoint.init_from, refuse a tokenizer file whose
    # content (sha256) differs from the one the run (or the source run) recorded; true
    # goes on with this one, recorded likewise.
    accept_changed_tokenizer: bool = field(default=False, metadata={"run_dir": "free"})

    def __post_init__(self) -> None:
        if self.on_corrupt not in ON_CORRUPT_CHOICES:
            raise UserError(f"checkpoint.on_corrupt: expected one of {ON_CORRUPT_CHOICES}, got {self.on_corrupt!r}")
        if self.every < 1:
            raise UserError(f"checkpoint.every: expected >= 1 steps, got {self.every}")
        if self.keep < 1:
            raise UserError(f"checkpoint.keep: expected >= 1, got {self.keep}")
        if self.init_mode not in INIT_MODES:
            raise UserError(f"checkpoint.init_mode: expected one of {INIT_MODES}, got {self.init_mode!r}")


@dataclass
class LoggingArgs:
    """metrics.jsonl, progress bar and wandb (group ``configs/logging``)."""

    # A run dir's config may change these with checkpoint.allow_config_change (config_check.py).
    RUN_DIR: ClassVar[str] = "safe"
    # Write a metrics.jsonl line (and a wandb point) every this many steps. Also the host
    # sync cadence: the loop reads the loss and grad norm from the device, and on several
    # ranks agrees on a preemption signal (SIGUSR2, SIGTERM, Ctrl-C), only every this
    # many steps (and before a save and at the end), so a signal is honoured within this
    # many steps; one rank honours it at the next step (docs/errors_and_signals.md).
    every: int = 10
    # tqdm progress bar on rank 0 (on a terminal; elsewhere a plain line per logged step).
    # false: that line at most every quiet_s seconds.
    progress_bar: bool = field(default=True, metadata={"run_dir": "free"})
    # Without a bar, a step line at least every this many seconds while steps run, so a
    # job's log is never silent for long (and, with progress_bar=false, at most this often).
    quiet_s: float = field(default=60.0, metadata={"run_dir": "free"})
    # wandb mode: "offline" (default; sync later with `wandb sync`), "online" (needs a
    # login) or "disabled". Nothing ever prompts for a login.
    wandb_mode: str = "offline"
    wandb_project: str = "mta-repro"
    # Run name; None = the run directory's name.
    wandb_name: str | None = None

    def __post_init__(self) -> None:
        if self.every < 1:
            raise UserError(f"logging.every: expected >= 1, got {self.every}")
        if not self.quiet_s > 0:
            raise UserError(f"logging.quiet_s: expected seconds > 0, got {self.quiet_s}")
        if self.wandb_mode not in WANDB_MODES:
            raise UserError(f"logging.wandb_mode: expected one of {WANDB_MODES}, got {self.wandb_mode!r}")


@dataclass
class DistributedArgs:
    """Process group and FSDP2 (group ``configs/distributed``)."""

    # Performance settings: may change within a run dir with checkpoint.allow_config_change.
    RUN_DIR: ClassVar[str] = "safe"
    # "auto" = nccl on cuda, gloo on cpu.
    backend: str = "auto"
    # FSDP2 mixed precision on GPU (parameters gathered in this dtype, gradients
    # reduced in reduce_dtype). Ignored on CPU, which trains in float32.
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    # Free the gathered parameters after each block's forward (ZeRO-3); False keeps
    # them until backward (ZeRO-2-like, more memory, less communication).
    reshard_after_forward: bool = True
    # Recompute each block's activations in backward.
    activation_checkpointing: bool = False
    # torch.compile each block.
    compile: bool = False
    # TF32 matmuls on Ampere+ (the paper: off).
    allow_tf32: bool = False
    # Process-group timeout in minutes: how long a rank waits for the others at a collective
    # (the rendezvous, a checkpoint's write) before it fails. At least 1; at most a year.
    timeout_min: int = field(default=30, metadata={"run_dir": "free"})

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "nccl", "gloo"):
            raise UserError(f"distributed.backend: expected auto, nccl or gloo, got {self.backend!r}")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in ("bfloat16", "float16", "float32"):
                raise UserError(
                    f"distributed.{name}: expected bfloat16, float16 or float32, got {getattr(self, name)!r}"
                )
        t = self.timeout_min
        if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= TIMEOUT_MAX_MIN:
            raise UserError(
                f"distributed.timeout_min: expected whole minutes from 1 to {TIMEOUT_MAX_MIN:,} (a year), got {t!r}"
            )


# The SlurmArgs fields that name things of the site, rendered as `#SBATCH --<field>=<value>`.
SITE_FIELDS = ("partition", "account", "qos", "constraint")


@dataclass
class SlurmArgs:
    """What ``python -m mta_repro.pipeline.submit`` (and the engine, for every training job of a
    plan or a ``-m`` sweep) renders into slurm/train.sbatch."""

    RUN_DIR: ClassVar[str] = "free"  # resources: nothing a run's numbers depend on
    nodes: int = 1
    # GPUs per node. 0 = a CPU partition: no GPU request (set tasks_per_node).
    gpus_per_node: int = 8
    # Ranks per node; null = one per GPU (gpus_per_node). Required when gpus_per_node=0.
    tasks_per_node: int | None = None
    # CPUs per rank, passed to sbatch and to srun (srun no longer inherits it, SLURM >= 22.05).
    # 8 x 8 GPU ranks = 64: fits the smallest common 8-GPU node (64 cores); a GPU rank needs
    # its main thread, the data prefetch thread, the async checkpoint writer and a few
    # intra-op threads (OMP_NUM_THREADS = half of this). More where the nodes have them:
    # `scontrol show node <node>` shows CPUTot.
    cpus_per_task: int = 8
    # Wall-clock limit in minutes.
    time_min: int = 4320
    # The site's names (sbatch --partition, --account, --qos, --constraint); null leaves
    # the flag out (the cluster's defaults). `sinfo -s` lists partitions, `sacctmgr show
    # assoc user=$USER` accounts and QoS, `sinfo -o "%N %f"` node features.
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    # Seconds before the time limit at which SLURM sends SIGUSR2 (requeue + checkpoint).
    signal_s: int = 120
    job_name: str = "mta"
    # srun --cpu-bind value ("none": the ranks' data workers may use all the task's
    # CPUs); null leaves the flag out, for clusters without binding support
    # (TaskPlugin=task/none, e.g. scripts/slurm_local.sh), where srun warns about it.
    cpu_bind: str | None = "none"
    # sbatch --mem per node ("480G"; "0" = all of it); null = the cluster's default
    # (DefMemPerCPU x CPUs, which may not hold rank 0's full fp32 model and the DCP staging).
    mem: str | None = None
    # sbatch --exclusive: whole nodes (no other job's ranks on the GPUs' CPUs/NICs).
    exclusive: bool = False

    def __post_init__(self) -> None:
        for name in ("nodes", "cpus_per_task", "time_min"):
            if getattr(self, name) < 1:
                raise UserError(f"slurm.{name}: expected >= 1, got {getattr(self, name)}")
        if self.gpus_per_node < 0:
            raise UserError(f"slurm.gpus_per_node: expected >= 0 (0 = CPU nodes), got {self.gpus_per_node}")
        if self.tasks_per_node is None and self.gpus_per_node == 0:
            raise UserError(
                "slurm.tasks_per_node: required when slurm.gpus_per_node=0 (CPU nodes), e.g. slurm.tasks_per_node=2"
            )
        if self.tasks_per_node is not None and self.tasks_per_node < 1:
            raise UserError(f"slurm.tasks_per_node: expected >= 1 or null, got {self.tasks_per_node}")
        if self.signal_s < 0:
            raise UserError(f"slurm.signal_s: expected >= 0, got {self.signal_s}")

    @property
    def ntasks_per_node(self) -> int:
        """Ranks per node: tasks_per_node, else one per GPU."""
        return self.tasks_per_node if self.tasks_per_node is not None else self.gpus_per_node
