"""Refuse, before anything is allocated, a model that cannot fit the device it would train on.

A config such as ``model.dim=65536`` would otherwise fail at materialisation with a
multi-gigabyte allocation traceback, or, without a memory limit, bring the OOM killer to
the node. ``check_fits`` runs on rank 0 before the run directory is touched:

1. a floor that needs no model run: the fp32 parameters and AdamW moments on this rank
   (12 bytes per parameter / world size) plus one fp32 copy of the logits of a micro-batch;
2. when the floor is over 5% of the capacity, or on a GPU (seconds against a GPU job), the
   trainer's memory pre-flight (``mta_repro.estimate.memory.estimate_memory``: one step on ``meta``).

Refused when either is over the capacity: the GPU's free memory, or on the CPU the memory
available to this process: the smallest of ``MemAvailable`` and the limits of its own cgroup
and the cgroup's ancestors (v1 and v2; both shared by the ranks of this node), and
``ulimit -v`` (RLIMIT_AS, per process). On the CPU the pre-flight counts tensors only, so the process's own resident
memory (interpreter, torch, the imported libraries: what it holds at the check) and the
allocator's slack (glibc keeps freed blocks resident: ``CPU_SLACK``) are added to it, and the
resident part to what it may use. Over 90% (the pre-flight's own rule for fitting) is one
warning line.
``trainer.memory_check=false`` skips it (e.g. for swap the estimate does not count).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from mta_repro.errors import UserError

log = logging.getLogger(__name__)

GB = 1e9
ROOT = Path("/")  # where /proc and /sys are read (a fake tree in tests)
FULL_ESTIMATE_FRACTION = 0.05  # below this share of the capacity the floor alone is enough
# Resident memory above the pre-flight's tensors, as a share of them (docs/memory.md has the
# runs): under glibc's dynamic mmap threshold 14.9% at 1B width with one layer, 7.2% with
# three, about 7% at 24 (OOM-killed at 22.4 GB with 20.8 counted); with
# trainer.cpu_mmap_threshold set, 2.4% above it at 300M width (no FSDP), below it at 1B
# width with three layers.
CPU_SLACK = {"glibc default": 0.15, "mmap threshold fixed": 0.05}


FIX = (
    "lower model.dim / model.n_layers, data.batch_size or data.seq_len, train on more ranks, or set "
    "trainer.memory_check=false to start anyway"
)


class DoesNotFitError(UserError):
    """The model, batch and world size need more memory than the device has."""


def _meminfo_available(root: Path | None = None) -> float | None:
    try:
        for line in ((root or ROOT) / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _mounts(root: Path) -> dict[str, tuple[str, str]]:
    """{"v1": (hierarchy root, mount point), "v2": ...} of the memory cgroup's mounts in
    /proc/self/mountinfo (the cgroup v1 hierarchy with the memory controller, the unified v2
    one); the usual places where there is no mountinfo."""
    found = {}
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            found.setdefault("v2", (fields[3], fields[4]))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            found.setdefault("v1", (fields[3], fields[4]))
    if not found:
        found = {"v2": ("/", "/sys/fs/cgroup"), "v1": ("/", "/sys/fs/cgroup/memory")}
    return found


def cgroup_limits(root: Path | None = None) -> list[tuple[float, str]]:
    """(bytes still free, what) for each memory limit on this process's own cgroup and its
    ancestors, from /proc/self/cgroup: cgroup v2's ``memory.max`` (``max``: none) under the
    unified mount, v1's ``memory.limit_in_bytes`` (2^60 and up: none) under the memory
    controller's. Free = the limit minus the cgroup's usage (``memory.current`` /
    ``memory.usage_in_bytes``) less its inactive page cache, which the kernel reclaims before
    it kills (``memory.stat``'s ``inactive_file`` / ``total_inactive_file``). A SLURM job's
    limit is on its own cgroup, not on the hierarchy's root. ``root``: a fake filesystem root
    (tests; default ``ROOT``)."""
    root = root or ROOT
    mounts = _mounts(root)
    out = []
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            version, files = "v2", ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            version, files = "v1", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        if version not in mounts:
            continue
        mount_root, mount_point = mounts[version]
        rel = path[len(mount_root) :] if path.startswith(mount_root) and mount_root != "/" else path
        top = root / mount_point.lstrip("/")
        d = top / rel.strip("/")
        while True:
            limit_s = _read(d / files[0])
            if limit_s is not None and limit_s != "max":
                try:
                    limit = float(limit_s)
                    usage = float(_read(d / files[1]) or 0)
                except ValueError:
                    limit = usage = float("inf")
                if limit < 2**60:
                    stat = dict(ln.split()[:2] for ln in (_read(d / "memory.stat") or "").splitlines() if " " in ln)
                    usage -= min(float(stat.get(files[2], 0)), usage)
                    where = "/" + str(d.relative_to(top)).strip(".").strip("/")
                    out.append(
                        (
                            max(limit - usage, 0.0),
                            f"the cgroup {where} ({version} {files[0]}) limits memory to {limit / GB:.2f} GB, "
                            f"{max(limit - usage, 0.0) / GB:.2f} GB of it free",
                        )
                    )
            if d == top or top not in d.parents:
                break
            d = d.parent
    return out


def _cgroup_available(root: Path | None = None) -> tuple[float, str] | None:
    """The smallest of ``cgroup_limits``, or None where no cgroup limits this process."""
    limits = cgroup_limits(root)
    return min(limits) if limits else None


def _address_space_left() -> tuple[float, str] | None:
    """RLIMIT_AS (``ulimit -v``) minus this process's address space now: every allocation
    counts against it (mmap'd tensors whole), and past it torch's CPU allocator raises."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        vsz = float(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        vsz = 0.0
    left = max(soft - vsz, 0.0)
    return left, (
        f"ulimit -v (RLIMIT_AS) allows this process {soft / GB:.2f} GB of address space, "
        f"{left / GB:.2f} GB of it unused"
    )


def resident_bytes() -> float:
    """This process's resident memory now (0 where /proc is not there)."""
    try:
        return float(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0.0


def cpu_overheads(pre_flight: float, mmap_threshold) -> dict:
    """What a CPU rank holds beyond the pre-flight's tensors, by name (bytes): its resident
    memory now and the allocator's slack (``CPU_SLACK``) under ``trainer.cpu_mmap_threshold``."""
    rule = "glibc default" if mmap_threshold is None else "mmap threshold fixed"
    return {
        "process (interpreter, torch, libraries)": resident_bytes(),
        f"allocator slack ({CPU_SLACK[rule]:.0%}, {rule})": CPU_SLACK[rule] * pre_flight,
    }


def local_ranks() -> int:
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        try:
            return max(1, int(os.environ[var].split("(")[0]))
        except (KeyError, ValueError):
            continue
    return 1


def capacity(device: torch.device) -> tuple[float, str]:
    """(bytes one rank may still allocate, what that is) on ``device``. On the CPU the smallest
    of: ``MemAvailable`` and the limits of this process's cgroups (both shared by the node's
    ranks), and RLIMIT_AS (``ulimit -v``, per process)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"{torch.cuda.get_device_name(device)} has {free / GB:.2f} GB free"
    meminfo = _meminfo_available()
    shared = [(meminfo, f"this machine has {meminfo / GB:.2f} GB of memory available")] if meminfo is not None else []
    cgroup = _cgroup_available()
    shared += [cgroup] if cgroup is not None else []
    n = local_ranks()
    found = [(b / n, what + (f" / {n} ranks on this node" if n > 1 else "")) for b, what in shared]
    address_space = _address_space_left()
    found += [address_space] if address_space is not None else []
    if not found:
        return float("inf"), "the CPU's memory is unknown"
    return min(found)


def check_fits(args, world_size: int, device: torch.device, cap: tuple | None = None):
    """Refuse (``DoesNotFitError``, one line) a training config whose memory on one rank is
    over ``cap`` = (bytes, description), by default the device's (``capacity``). Returns the
    pre-flight's estimate when it ran, else None."""
    from mta_repro.model import build_model, to_model_args

    if not args.trainer.memory_check:
        return None
    cap_bytes, cap_what = cap if cap is not None else capacity(device)
    model_args = to_model_args(args.model)
    n_params = sum(p.numel() for p in build_model(model_args, device="meta").parameters())
    batch, seq = int(args.data.batch_size), int(args.data.seq_len)
    floor = 12 * n_params / world_size + 4 * batch * seq * model_args.vocab_size
    fix = FIX
    shape = (
        f"model.dim={model_args.dim}, model.n_layers={model_args.n_layers}: {n_params / 1e9:.2f}B parameters, "
        f"micro-batch {batch} x {seq} tokens, world size {world_size}"
    )
    if floor > cap_bytes:
        raise DoesNotFitError(
            f"{shape}: needs at least {floor / GB:.2f} GB per rank (fp32 parameters, AdamW moments and one "
            f"fp32 copy of the logits) but {cap_what}: {fix}"
        )
    if device.type != "cuda" and floor < FULL_ESTIMATE_FRACTION * cap_bytes:
        return None
    from mta_repro.estimate.memory import HEADROOM, estimate_memory

    on_gpu = device.type == "cuda"
    dtype = getattr(torch, args.distributed.param_dtype) if on_gpu else torch.float32
    fused = None if args.optim.fused is None else bool(args.optim.fused)
    ac = bool(args.distributed.activation_checkpointing)
    est = estimate_memory(
        model_args,
        batch,
        seq,
        world_size,
        ac,
        dtype,
        "cuda" if on_gpu else "cpu",
        int(args.trainer.grad_accum),
        fused,
        int(args.trainer.loss_chunk),
    )
    need, have, terms = est.total, cap_bytes, ""
    if not on_gpu:
        extra = cpu_overheads(est.total, args.trainer.cpu_mmap_threshold)
        held = next(iter(extra.values()))  # already resident, so out of MemAvailable too
        need, have = need + sum(extra.values()), have + held
        terms = " + " + " + ".join(f"{v / GB:.2f} GB {k}" for k, v in extra.items())
        cap_what += f" (+ the {held / GB:.2f} GB this process holds)"
        if args.trainer.cpu_mmap_threshold is None:
            fix = fix.replace(", or set", ", set trainer.cpu_mmap_threshold=131072 (less slack), or set")
    if need > have:
        raise DoesNotFitError(
            f"{shape}: needs {need / GB:.2f} GB per rank ({est.total / GB:.2f} GB by the memory pre-flight, python -m "
            f"mta_repro.estimate ... --memory{terms}) but {cap_what}: {fix}"
        )
    if need > HEADROOM * have:
        log.warning(
            f"[mta_repro.train] WARNING: this rank needs {need / GB:.2f} GB by the memory pre-flight{terms}, over "
            f"{HEADROOM:.0%} of the capacity ({cap_what}): the run may run out of memory"
        )
    return est
