"""Small SLURM helpers shared by the training, evaluation and pipeline job scripts
(``mta_repro.pipeline.submit``, ``mta_repro.eval.submit``, ``mta_repro.pipeline.run``)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from mta_repro.errors import UserError


def time_limit(minutes: int) -> str:
    """sbatch's ``--time`` in days-hours:minutes:seconds (``2880`` -> ``2-00:00:00``)."""
    d, rem = divmod(int(minutes), 24 * 60)
    h, m = divmod(rem, 60)
    return f"{d}-{h:02d}:{m:02d}:00"


def memory_lines(mem: str | None, exclusive: bool) -> str:
    """The ``#SBATCH --mem`` / ``--exclusive`` lines (each ending in a newline), or "".

    mem: sbatch's per-node memory (``"480G"``; ``"0"`` = all of the node's memory).
    Without it a job gets the cluster's DefMemPerCPU x CPUs, which may not hold rank 0's
    full fp32 model (it broadcasts the initial weights) plus the checkpoint staging."""
    out = ""
    if mem is not None and str(mem) != "":
        out += f"#SBATCH --mem={mem}\n"
    if exclusive:
        out += "#SBATCH --exclusive\n"
    return out


class SubmitError(UserError):
    """sbatch is missing or refused the script (the message is one line, with sbatch's
    own): exit status 2, like a user error, since the fix is the submitter's (a partition,
    account or limit the cluster does not accept, a submit host)."""


def sbatch(script_path: Path, extra_args: Sequence[str] = ()) -> str:
    """Submit with ``sbatch --parsable``; the job id. SubmitError (one line) when sbatch
    is missing or refuses, quoting sbatch's own message."""
    cmd = ["sbatch", "--parsable", *extra_args, str(script_path)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise SubmitError(
            f"sbatch is not on PATH: --submit needs a SLURM submit host (the script is written to "
            f"{script_path}; --dry-run prints it; scripts/slurm_local.sh starts a local cluster here)"
        ) from None
    except subprocess.TimeoutExpired:
        raise SubmitError(f"sbatch {script_path} did not answer within 120 s (is slurmctld up?)") from None
    if out.returncode != 0:
        said = " | ".join(l.strip() for l in (out.stderr + out.stdout).splitlines() if l.strip())
        raise SubmitError(f"sbatch refused {script_path} (exit {out.returncode}): {said or 'no message'}")
    # --parsable prints "jobid" or "jobid;cluster".
    return out.stdout.strip().split(";")[0]


# ------------------------------------------------------------------ the rendezvous host
def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a SLURM node list, in SLURM's order, without SLURM: what
    ``scontrol show hostnames`` prints for the lists SLURM writes (``gpu-[001-004,010]``,
    ``a1,b[2-3]``, ``x[1-2]y[3-4]``; zero padding kept). Used only where ``scontrol`` is
    absent (a launch outside SLURM's tools). It also expands a suffix after a bracket
    (``node[1-2]-ib`` -> node1-ib, node2-ib), which SLURM 22.05's scontrol refuses as an
    invalid hostlist (and never writes: it keeps ``node1-ib,node2-ib`` uncompressed)."""
    hosts: list[str] = []
    depth, start = 0, 0
    text = nodelist.strip()
    for i, ch in enumerate(text + ","):  # split at commas outside brackets
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            if text[start:i]:
                hosts.extend(_expand_one(text[start:i]))
            start = i + 1
    return hosts


def _expand_one(pattern: str) -> list[str]:
    """One comma-free host pattern: the cartesian product of its bracket ranges."""
    open_ = pattern.find("[")
    if open_ < 0:
        return [pattern]
    close = pattern.find("]", open_)
    if close < 0:
        raise UserError(f"node list {pattern!r}: '[' without ']'")
    head, body, tail = pattern[:open_], pattern[open_ + 1 : close], pattern[close + 1 :]
    values: list[str] = []
    for part in body.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise UserError(f"node list {pattern!r}: range {part!r} is not N or N-M")
        width = len(lo)  # "001-010": zero padded to the first bound's width, as SLURM does
        values.extend(str(v).zfill(width) for v in range(int(lo), int(hi or lo) + 1))
    return [head + v + rest for v in values for rest in _expand_one(tail)]


def hostnames(nodelist: str) -> list[str]:
    """The hosts of a node list as SLURM expands them (``scontrol show hostnames``), or by
    :func:`expand_nodelist` when scontrol is not installed."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return expand_nodelist(nodelist)
    except subprocess.TimeoutExpired:
        raise UserError(f"SLURM_JOB_NODELIST={nodelist}: scontrol show hostnames did not answer within 60 s") from None
    names = out.stdout.split()
    if out.returncode != 0 or not names:
        said = (out.stderr or out.stdout).strip().replace("\n", " | ") or "no hosts"
        raise UserError(f"SLURM_JOB_NODELIST={nodelist}: scontrol show hostnames says: {said}")
    return names


def node_address(name: str) -> str:
    """Where to reach node ``name``: the name itself when it resolves (the usual site),
    else the NodeAddr SLURM has for it (``scontrol show node``: node names need not be
    host names, e.g. the local cluster's n1..n4 at 127.0.0.1)."""
    import socket

    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        pass
    try:
        out = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        out = None
    found = re.search(r"\bNodeAddr=(\S+)", out.stdout) if out is not None else None
    if found is None:
        raise UserError(
            f"SLURM node {name}: its name does not resolve and scontrol show node gives no NodeAddr; set "
            "MASTER_ADDR to the first node's address"
        )
    return found.group(1)


def rendezvous_host(nodelist: str) -> str:
    """The address of the first node of a job's node list (rank 0's node)."""
    return node_address(hostnames(nodelist)[0])
