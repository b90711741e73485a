"""The CPU pre-flight's capacity (mta_repro/estimate/memory_check.py): the process's own cgroup
and its ancestors (v1 and v2, read from /proc/self/cgroup and /proc/self/mountinfo), the
smallest limit, and RLIMIT_AS (``ulimit -v``), against MemAvailable. The cgroup trees are
fabricated under a fake root directory; RLIMIT_AS is a real one, set in a child process."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mta_repro.cli import run_cli
from mta_repro.estimate import memory_check

TRAIN = ["experiment=debug", "trainer.steps=1", "logging.wandb_mode=disabled", "logging.progress_bar=false"]
# the case: 3.22 GB needed on the CPU (2.44 GB of fp32 tensors by the pre-flight, the
# process, glibc's slack), refused under a 3 GB limit
BIG = ["model.dim=1024", "model.n_layers=10", "trainer.device=cpu"]
V1_UNLIMITED = "9223372036854771712"  # what v1 shows for "no limit" (PAGE_COUNTER_MAX pages)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root


def _mountinfo(*mounts: tuple[str, str, str, str]) -> str:
    """mountinfo lines for (hierarchy root, mount point, fstype, super options)."""
    return "".join(
        f"{30 + i} 23 0:{40 + i} {r} {mp} rw,relatime - {fs} {fs} {opts}\n"
        for i, (r, mp, fs, opts) in enumerate(mounts)
    )


def test_v1_reads_the_own_cgroup_and_its_ancestors_not_the_hierarchys_root(tmp_path):
    """A SLURM job's limit is on its own cgroup: the hierarchy's root says unlimited."""
    job = "sys/fs/cgroup/memory/slurm/uid_0/job_7"
    root = _tree(
        tmp_path,
        {
            "proc/self/cgroup": "5:cpu,cpuacct:/slurm/uid_0/job_7\n4:memory:/slurm/uid_0/job_7/step_0\n0::/\n",
            "proc/self/mountinfo": _mountinfo(
                ("/", "/sys/fs/cgroup/memory", "cgroup", "rw,memory"),
                ("/", "/sys/fs/cgroup/cpu,cpuacct", "cgroup", "rw,cpu,cpuacct"),
            ),
            "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
            "sys/fs/cgroup/memory/memory.usage_in_bytes": "20000000000",
            "sys/fs/cgroup/memory/slurm/uid_0/memory.limit_in_bytes": V1_UNLIMITED,
            f"{job}/memory.limit_in_bytes": "3000000000",
            f"{job}/memory.usage_in_bytes": "500000000",
            f"{job}/memory.stat": "cache 200000000\ntotal_inactive_file 100000000\n",
            f"{job}/step_0/memory.limit_in_bytes": V1_UNLIMITED,
            f"{job}/step_0/memory.usage_in_bytes": "400000000",
        },
    )
    limits = memory_check.cgroup_limits(root)
    assert len(limits) == 1
    free, what = limits[0]
    assert free == 3e9 - (5e8 - 1e8)  # the limit less the usage that is not reclaimable page cache
    assert "/slurm/uid_0/job_7 (v1 memory.limit_in_bytes)" in what and "3.00 GB" in what


def test_v2_nested_limits_take_the_smallest_and_max_is_none(tmp_path):
    base = "sys/fs/cgroup"
    root = _tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/a/b/c\n",
            "proc/self/mountinfo": _mountinfo(("/", "/sys/fs/cgroup", "cgroup2", "rw,nsdelegate")),
            f"{base}/a/memory.max": "2000000000\n",
            f"{base}/a/memory.current": "1500000000\n",
            f"{base}/a/b/memory.max": "max\n",
            f"{base}/a/b/memory.current": "1400000000\n",
            f"{base}/a/b/c/memory.max": "4000000000\n",
            f"{base}/a/b/c/memory.current": "1200000000\n",
            f"{base}/a/b/c/memory.stat": "anon 1000000000\ninactive_file 200000000\n",
        },
    )
    limits = sorted(memory_check.cgroup_limits(root))
    assert [b for b, _ in limits] == [2e9 - 1.5e9, 4e9 - (1.2e9 - 0.2e9)]
    assert "the cgroup /a (v2 memory.max)" in limits[0][1]
    assert memory_check._cgroup_available(root) == limits[0]
    # "max" all the way up: no cgroup limit, only MemAvailable counts
    for d in ("a", "a/b/c"):
        (tmp_path / base / d / "memory.max").write_text("max\n")
    assert memory_check.cgroup_limits(root) == []
    assert memory_check._cgroup_available(root) is None


def test_a_mount_of_part_of_the_hierarchy_and_no_mountinfo(tmp_path):
    """A container sees its own cgroup (/docker/x in the hierarchy) mounted at /sys/fs/cgroup;
    without a mountinfo the usual mount points are read."""
    root = _tree(
        tmp_path / "container",
        {
            "proc/self/cgroup": "0::/docker/x/inner\n",
            "proc/self/mountinfo": _mountinfo(("/docker/x", "/sys/fs/cgroup", "cgroup2", "rw")),
            "sys/fs/cgroup/memory.max": "1000000000",
            "sys/fs/cgroup/memory.current": "0",
            "sys/fs/cgroup/inner/memory.max": "max",
        },
    )
    assert [b for b, _ in memory_check.cgroup_limits(root)] == [1e9]
    plain = _tree(
        tmp_path / "plain",
        {
            "proc/self/cgroup": "7:memory:/job\n",
            "sys/fs/cgroup/memory/job/memory.limit_in_bytes": "2500000000",
            "sys/fs/cgroup/memory/job/memory.usage_in_bytes": "500000000",
        },
    )
    assert [b for b, _ in memory_check.cgroup_limits(plain)] == [2e9]


def test_capacity_is_the_smallest_of_memavailable_and_the_cgroup_shared_by_the_ranks(tmp_path, monkeypatch):
    root = _tree(
        tmp_path,
        {
            "proc/meminfo": "MemTotal: 32000000 kB\nMemAvailable: 20000000 kB\n",
            "proc/self/cgroup": "0::/job\n",
            "sys/fs/cgroup/job/memory.max": "6000000000",
            "sys/fs/cgroup/job/memory.current": "1000000000",
        },
    )
    monkeypatch.setattr(memory_check, "ROOT", root)
    monkeypatch.setattr(memory_check, "_address_space_left", lambda: None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    have, what = memory_check.capacity(torch.device("cpu"))
    assert have == (6e9 - 1e9) / 2 and "the cgroup /job" in what and "/ 2 ranks" in what
    (root / "sys/fs/cgroup/job/memory.max").write_text("max")
    have, what = memory_check.capacity(torch.device("cpu"))
    assert have == 20000000 * 1024 / 2 and "this machine has 20.48 GB" in what


def test_a_start_over_the_jobs_cgroup_limit_is_refused_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    """The issue's case: 3.22 GB needed in a child cgroup limited to 3 GB on a machine with
    23 GB available: refused in one line naming the cgroup, rc 2, no run dir."""
    from mta_repro.estimate.memory import estimate_from_config
    from mta_repro.train import loop
    from mta_repro.train.config import compose

    root = _tree(
        tmp_path / "root",
        {
            "proc/meminfo": "MemAvailable: 23000000 kB\n",
            "proc/self/cgroup": "4:memory:/slurm/job_3\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
            "sys/fs/cgroup/memory/slurm/job_3/memory.limit_in_bytes": "3000000000",
            # the job's usage: this process, which the cgroup counts
            "sys/fs/cgroup/memory/slurm/job_3/memory.usage_in_bytes": str(int(memory_check.resident_bytes())),
        },
    )
    monkeypatch.setattr(memory_check, "ROOT", root)
    monkeypatch.setattr(memory_check, "_address_space_left", lambda: None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.setattr(loop, "run", lambda *a: pytest.fail("the model was built"))
    run_dir = tmp_path / "run"
    cfg = compose(TRAIN + BIG + [f"run_dir={run_dir}"])
    pre = estimate_from_config(cfg).total
    # with the process and glibc's slack (15%) over the job's limit, far under the machine's
    assert 3e9 < 1.15 * pre + memory_check.resident_bytes() < 23e9
    assert run_cli("train", lambda: loop.train(cfg)) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert "train: error:" in lines[0] and f"{pre / 1e9:.2f} GB by the memory pre-flight" in lines[0]
    assert "the cgroup /slurm/job_3 (v1 memory.limit_in_bytes) limits memory to 3.00 GB" in lines[0]
    assert not run_dir.exists()


def _limit_address_space(limit: int):
    def set_it():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return set_it


@pytest.mark.skipif(not Path("/proc/self/statm").is_file(), reason="reads /proc/self/statm")
def test_ulimit_v_is_counted_in_a_real_child(tmp_path):
    """A real RLIMIT_AS (``ulimit -v``) of 3 GB: the start is refused in one line naming it,
    before the model is built (no DefaultCPUAllocator traceback), rc 2, nothing written."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mta_repro.train", *TRAIN, *BIG, f"run_dir={run_dir}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        preexec_fn=_limit_address_space(3 * 10**9),
        timeout=600,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "ulimit -v (RLIMIT_AS) allows this process 3.00 GB of address space" in lines[0]
    assert "model.dim=1024, model.n_layers=10" in lines[0]
    assert not run_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_logged_peak_memory_is_in_the_pre_flights_gb():
    """metrics.jsonl's peak_mem_gb is GB = 1e9 bytes, as the pre-flight prints (not 2^30):
    on the CPU the peak resident set, read here from /proc/self/status's VmHWM (kB = KiB)."""
    from mta_repro.estimate.memory import GB
    from mta_repro.train.metrics import peak_mem_gb

    status = Path("/proc/self/status")
    if not status.is_file():
        pytest.skip("reads /proc/self/status")
    before = next(int(ln.split()[1]) for ln in status.read_text().splitlines() if ln.startswith("VmHWM:"))
    got = peak_mem_gb(torch.device("cpu"))
    after = next(int(ln.split()[1]) for ln in status.read_text().splitlines() if ln.startswith("VmHWM:"))
    assert GB == 1e9
    assert before * 1024 / 1e9 <= got <= after * 1024 / 1e9
