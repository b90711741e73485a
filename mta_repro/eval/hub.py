"""The HF hub as the evaluation meets it: offline detected up front, its failure in one line.

lm-eval's registered tasks (and BabiLong's HF data) load their datasets from the hub or
its local cache. On a machine without internet, ``datasets`` retries for ~30 s and ends
in a ``ConnectionError`` traceback several frames deep. Here:

* ``offline_if_unreachable()`` probes the hub's host once (a TCP connect, ~2 s at most)
  and, when it cannot be reached, sets ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` so that
  cached datasets still load and missing ones fail at once. It does nothing when those
  variables are already set or a proxy is configured (a direct connect says nothing then).
* ``hub_errors(tasks)`` turns a hub/network failure into a ``UserError`` that names the
  task, the dataset and the fix (a local task YAML: ``python -m mta_repro.eval.lm_eval_tasks``).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from urllib.parse import urlparse

from mta_repro.errors import UserError

_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
# Exception classes (by name, anywhere in the MRO) that mean "the hub was not reached":
# builtins' ConnectionError (what datasets raises), requests' ConnectionError, httpx's
# ConnectError/ConnectTimeout, huggingface_hub's offline and cache-miss errors.
_HUB_FAILURES = ("ConnectionError", "ConnectError", "ConnectTimeout", "OfflineModeIsEnabled", "LocalEntryNotFoundError")


def hub_host() -> tuple:
    """(host, port) of the hub endpoint (``HF_ENDPOINT``, default huggingface.co)."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def reachable(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether a TCP connection to host:port opens within ``timeout`` seconds (DNS included:
    the lookup runs in a thread, since getaddrinfo ignores socket timeouts)."""
    import socket

    ok = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return bool(ok)


_probed: dict = {}  # (host, port) -> reachable: one probe a process
_switched_offline = False  # set when offline_if_unreachable switched the libraries over


def offline_if_unreachable(timeout: float = 2.0) -> bool:
    """Switch the HF libraries to offline mode when the hub cannot be reached; True if it did."""
    global _switched_offline
    if any(os.environ.get(v) for v in _OFFLINE_VARS + _PROXY_VARS):
        return False
    if _probed.get(hub_host()) is None:
        _probed[hub_host()] = reachable(*hub_host(), timeout=timeout)
    if _probed[hub_host()]:
        return False
    _switched_offline = True
    for v in _OFFLINE_VARS:
        os.environ[v] = "1"
    # Libraries read these at import; patch the ones already imported.
    for mod, attr in (
        ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_DATASETS_OFFLINE"),
    ):
        m = sys.modules.get(mod)
        if m is not None and hasattr(m, attr):
            setattr(m, attr, True)
    return True


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


_HUB_MODULES = ("huggingface_hub", "datasets", "requests", "httpx", "httpcore", "urllib3")


def is_hub_failure(exc: BaseException) -> bool:
    """A connection failure of the HF libraries (not, say, a rank's broken pipe): one of
    ``_HUB_FAILURES`` raised by an HTTP/hub library or saying it is about the hub."""
    for e in _chain(exc):
        names = {c.__name__ for c in type(e).__mro__}
        if not names & set(_HUB_FAILURES):
            continue
        where = type(e).__module__.split(".")[0]
        if where in _HUB_MODULES or "hub" in str(e).lower() or "huggingface" in str(e).lower():
            return True
    return False


def _failed_task(exc: BaseException) -> str | None:
    """The lm-eval task being built when the failure happened (a ``self.config.task`` in its
    traceback), if any."""
    for e in _chain(exc):
        for frame, _ in traceback.walk_tb(e.__traceback__):
            name = getattr(getattr(frame.f_locals.get("self"), "config", None), "task", None)
            if isinstance(name, str):
                return name
    return None


def describe(
    exc: BaseException, tasks: Sequence[str] = (), what: str | None = None, fix: str | None = None
) -> str | None:
    """The one-line message for a hub failure, or None if ``exc`` is something else.

    what/fix: who failed and the remedy; by default the lm-eval task (found in the
    traceback, else ``tasks``) and a local task YAML."""
    if not is_hub_failure(exc):
        return None
    text = " ".join(str(e) for e in _chain(exc))
    m = re.search(r"reach '([^']+)'", text)
    dataset = f"dataset {m.group(1)!r}" if m else "its dataset"
    task = _failed_task(exc) or (tasks[0] if len(tasks) == 1 else None)
    if what is None:
        what = f"lm-eval task {task!r}" if task else f"lm-eval tasks {list(tasks)}" if tasks else "evaluation"
    if fix is None:
        example = task or (tasks[0] if tasks else "TASK")
        fix = (
            f"use a local copy: python -m mta_repro.eval.lm_eval_tasks {example} test=FILE.jsonl --out DIR, "
            f"then --include_path DIR --tasks {example}_local"
        )
    offline = (
        f"{hub_host()[0]} cannot be reached"
        if _switched_offline
        else "HF_HUB_OFFLINE is set"
        if os.environ.get("HF_HUB_OFFLINE")
        else "the hub was not reached"
    )
    return (
        f"{what}: {dataset} is not in the local HF cache and {offline} ({type(exc).__name__}). "
        f"Run once where the hub is reachable (the cache then works offline), or {fix}"
    )


@contextmanager
def hub_errors(tasks: Sequence[str] = (), what: str | None = None, fix: str | None = None):
    """Re-raise a hub failure inside the block as a one-line UserError (see ``describe``)."""
    try:
        yield
    except Exception as e:  # re-raised unless describe() knows it for a hub failure
        msg = describe(e, tasks, what, fix)
        if msg is None:
            raise
        raise UserError(msg) from None
