"""metrics.jsonl, the progress bar, wandb and MFU.

MFU = achieved FLOP/s / (peak FLOP/s of one device * world size), with the model FLOPs per
token of the variant (``mta_repro.model.flops.model_flops_per_token``: the same whichever
implementation runs it) and the dense bf16 peak of the device that ran, looked up by its
name; ``hfu`` is the same ratio for the FLOPs the implementation performs
(``hardware_flops_per_token``: recomputation included). The peak is unknown on CPU (and
on unlisted GPUs), and both are then null.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mta_repro.files import replace_atomically

log = logging.getLogger(__name__)

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' datasheets.
# Longest matching name wins ("H100 PCIe" before "H100").
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "GH200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H800": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A6000": 155e12,
    "A10G": 70e12,
    "V100": 125e12,  # fp16 (no bf16 on V100)
}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size: Linux's ``VmHWM`` (the high-water mark of this
    process's own memory; ``reset_peak_rss`` restarts it), else ``ru_maxrss``. ``ru_maxrss``
    alone misleads: a process started by a large one (a launcher, a pytest worker) inherits
    its parent's peak (scripts/measure_memory.py measured 1.23 GB for a 1.0 GB step)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss * (1 if sys.platform == "darwin" else 1024)


def reset_peak_rss() -> bool:
    """Restart ``VmHWM`` at the current resident size (Linux >= 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_mem_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or on CPU the peak resident set size, in GB = 1e9
    bytes (the memory pre-flight's unit; ``peak_mem_gb`` in metrics.jsonl)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return peak_rss_bytes() / 1e9


def peak_mem_reserved_gb(device: torch.device | None = None) -> float | None:
    """Peak memory the CUDA caching allocator reserved from the driver (GB = 1e9 bytes): what the device
    really lost to this process (allocated + cached free blocks + fragmentation), the figure
    to hold against a GPU's capacity; None off CUDA (CPU reports RSS in ``peak_mem_gb``)."""
    if device is None:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_reserved(device) / 1e9


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None, world_size: int) -> float | None:
    if not peak:
        return None
    return tokens_per_s * flops_per_token / (peak * world_size)


def _line_problem(raw: bytes) -> tuple[int | None, str | None, bool]:
    """(step, problem, parses) of one metrics.jsonl line (without its newline): the integer
    ``step`` of a metric record, else what is wrong with the line; ``parses`` is False for a
    line that is not JSON text at all (what a torn write leaves)."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8 text", False
    except (ValueError, RecursionError):
        return None, "not JSON", False
    if not isinstance(record, dict):
        return None, f"JSON {type(record).__name__}, not an object", True
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None, 'no integer "step"', True
    return step, None, True


def truncate_after(path: Path, step: int) -> None:
    """Drop metric lines of steps after ``step`` (a crashed run logged them; the resumed
    run logs them again), and a last line that a kill cut short (not JSON).

    Every other line is kept byte for byte, a damaged one too (not UTF-8, not JSON, not an
    object, no integer ``step``: named on stderr, not guessed at), and counts as before
    ``step``. The file is rewritten atomically (temp file, fsync, rename), and only when a
    line is dropped."""
    path = Path(path)
    if not path.is_file():
        return
    if path.is_symlink():  # rewrite the file the link points at, not the link
        path = Path(os.path.realpath(path))
    lines = path.read_bytes().split(b"\n")
    if lines[-1] == b"":  # the newline after the last line, not a line
        lines.pop()
    keep, damaged, dropped, torn = [], [], 0, None
    for i, raw in enumerate(lines):
        if not raw.strip():  # blank: no record, harmless
            keep.append(raw)
            continue
        line_step, problem, parses = _line_problem(raw)
        if line_step is not None:
            if line_step <= step:
                keep.append(raw)
            else:
                dropped += 1
        elif i == len(lines) - 1 and not parses:
            torn = raw
        else:
            keep.append(raw)
            damaged.append((i + 1, problem))
    if damaged:
        shown = ", ".join(f"line {n}: {why}" for n, why in damaged[:10])
        more = f", and {len(damaged) - 10} more" if len(damaged) > 10 else ""
        numbers = ", ".join(str(n) for n, _ in damaged[:10]) + (", ..." if len(damaged) > 10 else "")
        log.warning(
            f"[mta_repro.train] {path}: kept {len(damaged)} damaged line{'s' if len(damaged) > 1 else ''} as they are "
            f"(line{'s' if len(damaged) > 1 else ''} {numbers}): {shown}{more}; they are not metric records"
        )
    if torn is not None:
        log.warning(
            f"[mta_repro.train] {path}: dropped its last line {len(lines)}, cut short by a killed run "
            f"({len(torn)} bytes: {torn[:60]!r}{'...' if len(torn) > 60 else ''})"
        )
    if dropped or torn is not None:
        replace_atomically(path, b"".join(raw + b"\n" for raw in keep))


def _ends_without_newline(path: Path) -> bool:
    """``path`` has bytes and the last one is not a newline (a line appended now would join it)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:
        return False


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def format_line(m: dict[str, Any], total: int) -> str:
    """One progress line (no carriage return) for logs that are not a terminal."""
    parts = [
        f"step {m['step']}/{total}",
        f"loss {m['loss']:.4f}",
        f"lr {m['lr']:.3g}",
        # One rank per device (GPU) or per process (CPU): "per rank" is right on both.
        f"tok/s {m['tokens_per_s_global']:.0f} global, {m['tokens_per_s_per_gpu']:.0f} per rank",
    ]
    if m.get("peak_mem_reserved_gb") is not None:
        parts.append(f"mem {m['peak_mem_gb']:.1f} GB allocated, {m['peak_mem_reserved_gb']:.1f} GB reserved")
    if m.get("val_loss") is not None:
        parts.append(f"val_loss {m['val_loss']:.4f} val_ppl {m['val_ppl']:.2f}")
    return "[mta_repro.train] " + " | ".join(parts)


class MetricLogger:
    """Rank 0 writes; other ranks call it harmlessly."""

    def __init__(self, run_dir: Path, logging_args, config: dict, is_main: bool, total: int, start: int):
        self.is_main = is_main
        self.path = Path(run_dir) / "metrics.jsonl"
        self.bar = None
        self.wandb = None
        if not is_main:
            return
        truncate_after(self.path, start)
        newline = _ends_without_newline(self.path)
        self.file = open(self.path, "a")  # noqa: SIM115 - the logger's file, closed by close()
        if newline:  # a last line without its newline: the next record starts a line of its own
            self.file.write("\n")
            self.file.flush()
        self.total = total
        # A tqdm bar only on a terminal; elsewhere (SLURM's .err files, pipes) one plain
        # line per logged step, no carriage returns. Without the bar (progress_bar=false)
        # the same line at most every logging.quiet_s seconds, and at the last step. Either way, a step line at
        # least every quiet_s seconds while steps run (a job's log is never silent for long).
        self.plain = logging_args.progress_bar and not _isatty(sys.stderr)
        self.quiet_s = float(getattr(logging_args, "quiet_s", 60.0))
        self.step, self.last_line = start, time.monotonic()
        self._since = (start, self.last_line)  # (step, time) of the last line: the heartbeat's rate
        if logging_args.progress_bar and not self.plain:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", dynamic_ncols=True, file=sys.stderr)
        wandb = None
        if logging_args.wandb_mode != "disabled":
            try:
                import wandb
            except ImportError:  # an extra (pip install 'mta-repro[wandb]'); metrics.jsonl has every number
                if logging_args.wandb_mode == "online":
                    raise ImportError("logging.wandb_mode=online needs wandb: pip install 'mta-repro[wandb]'") from None
                log.warning(
                    "wandb is not installed: logging to metrics.jsonl only (pip install 'mta-repro[wandb]', "
                    "or logging.wandb_mode=disabled to silence this)"
                )
        if wandb is not None:
            id_file = Path(run_dir) / "wandb_id.txt"
            run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
            id_file.write_text(run_id)
            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = wandb.init(
                project=logging_args.wandb_project,
                name=logging_args.wandb_name or Path(run_dir).resolve().name,
                dir=str(run_dir),
                id=run_id,
                resume="allow",
                mode=logging_args.wandb_mode,
                config=config,
            )

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.is_main:
            return
        if "peak_mem_gb" in metrics and "peak_mem_reserved_gb" not in metrics:
            # Reserved beside allocated: fragmentation shows only in the former.
            metrics = {**metrics, "peak_mem_reserved_gb": peak_mem_reserved_gb()}
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        if self.wandb is not None:
            points = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            self._to_wandb(lambda run: run.log(points, step=metrics["step"]))
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s_global']:.0f}")
        elif self.plain or metrics.get("step") == self.total or time.monotonic() - self.last_line >= self.quiet_s:
            self._line(format_line(metrics, self.total))

    def _line(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)
        self.last_line = time.monotonic()
        self._since = (self.step, self.last_line)

    def advance(self, n: int = 1) -> None:
        """A step done (rank 0: the bar, or a step line when none came for quiet_s seconds)."""
        if not self.is_main:
            return
        self.step += n
        if self.bar is not None:
            self.bar.update(n)
        elif time.monotonic() - self.last_line >= self.quiet_s:
            steps, since = self.step - self._since[0], time.monotonic() - self._since[1]
            self._line(
                f"[mta_repro.train] step {self.step}/{self.total} ({since / max(steps, 1):.1f} s a step; "
                "the loss at the next logged step)"
            )

    def close(self) -> None:
        if not self.is_main:
            return
        self.file.close()
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self._to_wandb(lambda run: run.finish())
            self.wandb = None

    def _to_wandb(self, call: Callable[[Any], Any]) -> None:
        """``call(run)``; if wandb's service is gone, one line and no more wandb in this
        process: the run goes on (to its checkpoint, when a signal stops it). Under SLURM
        the requeue that a preemption starts ends the job with SIGTERM (or a
        ``scancel --signal=INT``, SIGINT) to every process of the job step, the service's
        included, while the ranks still have a step and a save to finish. The service (a
        Go program in its own session) takes both signals whatever their inherited
        disposition, so it cannot be shielded from them; the ranks can go on without it."""
        try:
            call(self.wandb)
        except Exception as e:  # noqa: BLE001 - whatever wandb raises, metrics.jsonl has the numbers
            self.wandb = None
            # wandb's own exit hook would meet the same dead service (a traceback at exit)
            with contextlib.suppress(Exception):
                import wandb

                wandb.teardown()
            log.warning(
                f"[mta_repro.train] wandb stopped logging ({type(e).__name__}: {e}; its service process "
                "is gone, e.g. ended by the job's SIGTERM): metrics.jsonl keeps every number, and the "
                "next start logs to the same wandb run"
            )


class Throughput:
    """Tokens/s between two log points (wall clock, synchronised with the device)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.t = time.perf_counter()
        self.tokens = 0

    def add(self, n: int) -> None:
        self.tokens += n

    def rate(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        out = self.tokens / max(now - self.t, 1e-9)
        self.t, self.tokens = now, 0
        return out
