"""One clear line for command-line errors (train, slurm, eval, params, generate, hf,
pipeline), not a traceback.

User errors are ``mta_repro.errors.UserError`` (the input is wrong and the message says
what was expected) and Hydra/OmegaConf errors from the overrides (a bad key, a string
where a list is expected, an unknown config group option). Anything else is a fault in
the code or its environment and keeps its traceback. ``MTA_REPRO_TRACEBACK=1`` shows the
traceback of user errors too.
"""

from __future__ import annotations

import difflib
import logging
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mta_repro.errors import StopRequested, UserError, show_tracebacks


def user_errors() -> tuple:
    """The exception types reported as one line (none when MTA_REPRO_TRACEBACK is set)."""
    if show_tracebacks():
        return ()
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return (UserError, HydraException, OmegaConfBaseException)


def _unknown_key_line(exc: BaseException) -> str | None:
    """An override of a key the schema lacks (Hydra's composition error caused by OmegaConf's
    missing-key error) as our one line with the nearest field (the ``+`` form gets the same
    from the schema check)."""
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = exc.__cause__
    if not isinstance(exc, ConfigCompositionException) or not isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        return None
    full, owner = getattr(cause, "full_key", None), getattr(cause, "object_type", None)
    if not full or owner is None:
        return None
    from mta_repro.dataclass_config import unknown_keys_error

    parent = full.rpartition(".")[0]
    return unknown_keys_error(owner, [full], parent)


def _missing_option_line(exc: BaseException) -> str | None:
    """Hydra's ~40-line "Could not find 'experiment/debug_typo'" as one line."""
    from hydra.errors import MissingConfigException

    if not isinstance(exc, MissingConfigException) or not exc.options or not exc.missing_cfg_file:
        return None
    group, _, name = str(exc.missing_cfg_file).rpartition("/")
    return unknown_option_line(group, name, exc.options)


def unknown_option_line(group: str, value: str, options: Sequence[str]) -> str:
    """``group=value`` names no config: the nearest public options (``_name`` files are
    parts other configs include, not choices)."""
    public = sorted(o for o in options if not o.startswith("_"))
    near = difflib.get_close_matches(value, public, n=3, cutoff=0.5)
    if not near and value:  # a part of a name ("880m_mta"): the names that contain it
        near = [o for o in public if value.lower() in o.lower()][:3]
    line = f"{group}={value}: unknown {group} config"
    if near:
        line += f"; did you mean {' or '.join(near)}?"
    if len(public) <= 8:
        line += f" (expected one of {public})"
    elif len(public) <= 40:  # every choice, so that nobody has to list the folder
        line += f" ({len(public)} options in configs/{group}/: {', '.join(public)})"
    else:
        line += f" ({len(public)} options: the YAML files of configs/{group}/)"
    return line


def describe(exc: BaseException) -> str:
    """The exception and its causes, each once, on one line."""
    special = _unknown_key_line(exc) or _missing_option_line(exc)
    if special:
        return special
    parts, seen = [], set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        msg = " ".join(str(e).split())
        # OmegaConf appends "full_key: ... object_type=..." context lines: keep the message
        msg = msg.split(" full_key:")[0].strip()
        # "ValueError raised while resolving interpolation: <the message>": keep the message
        msg = re.sub(r"^\w+ raised while resolving interpolation: ", "", msg)
        if msg and not any(msg in p for p in parts):
            parts.append(msg)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    line = ": ".join(parts) or type(exc).__name__
    if "is not a ListConfig" in line or "is not a subclass of ListConfig" in line:
        line += " (write lists in brackets, e.g. tasks=[ppl])"
    return line


class _StderrNow(logging.StreamHandler):
    """A handler that writes to ``sys.stderr`` as it is when the line is written, not as it was
    when the handler was made (pytest's capsys and a caller's redirect replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # emit runs under the handler's lock
        super().emit(record)


def configure_logging() -> logging.Logger:
    """The package's diagnostics (its modules' ``logging.getLogger(__name__)``) as the command
    lines show them: INFO and up, each record one line on stderr as written (the messages
    carry their own ``[mta_repro.x] WARNING:`` where they have one), the same under Hydra's job
    as outside it. Not passed on to the root logger, whose handlers are the application's
    (Hydra's job log, lm-eval's). Once per process; run_cli calls it."""
    log = logging.getLogger("mta_repro")
    if not any(isinstance(h, _StderrNow) for h in log.handlers):
        handler = _StderrNow()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def honour_ctrl_c() -> None:
    """Take Ctrl-C (SIGINT) back where it was inherited ignored: a shell starts background
    commands (``cmd &``, ``nohup cmd &`` from a script) with SIGINT ignored, and a
    long-running tool would then evaluate or convert on through Ctrl-C and ``kill -INT``.
    The trainer installs its own handler (which saves first); every other entry point
    raises KeyboardInterrupt, as a foreground process does (docs/errors_and_signals.md).
    Only from the main thread (the only one that may set handlers)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run_cli(prog: str, fn: Callable[[], int]) -> int:
    """``fn()``'s exit code; a user error prints ``<prog>: error: <one line>`` and gives 2,
    Ctrl-C outside the training loop (which saves first) ``<prog>: interrupted`` and 130, a
    stop signal seen before there was anything to save (``StopRequested``) its one line and
    128 + the signal's number. An inherited, ignored SIGINT is taken back first
    (``honour_ctrl_c``), and the package's logging set up (``configure_logging``)."""
    honour_ctrl_c()
    configure_logging()
    try:
        return fn()
    except StopRequested as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 128 + e.signum
    except user_errors() as e:
        for line in getattr(e, "lines", None) or [describe(e)]:  # several findings: one line each
            print(f"{prog}: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if show_tracebacks():
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (OSError, RuntimeError) as e:  # a full disk where no caller named it (an eval JSON, a state file)
        from mta_repro.files import caused_by_enospc

        if show_tracebacks() or not caused_by_enospc(e):
            raise
        where = getattr(e, "filename", None)
        print(
            f"{prog}: error: no space left on device{f' writing {where}' if where else ''}; files are written "
            "whole or not at all: free space and rerun",
            file=sys.stderr,
        )
        return 2


def check_split_lists(argv: Sequence[str]) -> None:
    """An override whose list the shell split at its spaces (``key=[a, b]`` unquoted arrives
    as ``key=[a,`` and ``b]``): one line with the fix, not Hydra's grammar error."""
    for i, a in enumerate(argv):
        if "=" not in a or a.startswith("-"):
            continue
        value = a.split("=", 1)[1]
        if value.count("[") > value.count("]") or value.count("{") > value.count("}"):
            rest = list(argv[i + 1 :])
            whole = " ".join([a] + rest[: next((j + 1 for j, r in enumerate(rest) if "]" in r or "}" in r), 0)])
            key = a.split("=", 1)[0]
            raise UserError(
                f"{key}: the shell split this list at its spaces ({whole!r} arrived as several "
                f'arguments); quote the override, e.g. "{whole}", or write it without spaces'
            )


def check_group_options(overrides: Sequence[str], groups: Sequence[str], config_dir: Path) -> None:
    """``group=option`` overrides name a YAML file of configs/<group>/ (checked before Hydra,
    whose own message for ``model=880`` is about ints)."""
    for o in overrides:
        key, _, value = o.partition("=")
        key = key.lstrip("+~")
        if key in groups:
            options = sorted(p.stem for p in (config_dir / key).glob("*.yaml"))
            if value not in options:
                raise UserError(unknown_option_line(key, value, options))


@dataclass
class HydraArgs:
    """A Hydra-style command line (``python -m mta_repro.train [options] key=value ...``)
    read without Hydra's own (internal) parser: the overrides and the options the project
    keeps."""

    overrides: list
    multirun: bool = False  # -m / --multirun: a sweep, one job per point (the pipeline's engine)
    cfg: str | None = None  # --cfg job|hydra|all: print the composed config, run nothing
    resolve: bool = False  # --resolve: with --cfg, interpolations resolved
    help: bool = False  # -h / --help
    flags: list = field(default_factory=list)  # the project's own flags found (e.g. --no-check)


# Hydra's options the project does not keep, each with what does the same here
_REFUSED_OPTIONS = {
    "--config-name": "choose an experiment with experiment=<name> (the root config is configs/train.yaml)",
    "-cn": "choose an experiment with experiment=<name> (the root config is configs/train.yaml)",
    "--config-path": "add a folder of configs with 'hydra.searchpath=[file:///abs/dir]'",
    "-cp": "add a folder of configs with 'hydra.searchpath=[file:///abs/dir]'",
    "--config-dir": "add a folder of configs with 'hydra.searchpath=[file:///abs/dir]'",
    "-cd": "add a folder of configs with 'hydra.searchpath=[file:///abs/dir]'",
    "--info": "print the composed config with --cfg all",
    "--package": "print the composed config with --cfg job",
    "-p": "print the composed config with --cfg job",
    "--hydra-help": "see --help (Hydra's launcher and sweeper are not used: a sweep is a plan of the pipeline)",
    "--shell-completion": "list the options with --help",
    "-sc": "list the options with --help",
    "--run": "a run is the default; drop the option",
    "-r": "a run is the default; drop the option",
    "--version": "pip show hydra-core",
}


def parse_hydra_argv(argv: Sequence[str], prog: str, flags: Sequence[str] = ()) -> HydraArgs:
    """The overrides and options of ``argv`` (the project's own ``flags`` allowed too); an
    option Hydra has but the project does not keep is one line naming what does the same."""
    check_split_lists(argv)
    out = HydraArgs(overrides=[])
    it = iter(argv)
    for a in it:
        opt, eq, val = a.partition("=")
        if a in ("-m", "--multirun"):
            out.multirun = True
        elif opt in ("--cfg", "-c"):
            out.cfg = val if eq else next(it, None)
            if out.cfg not in ("job", "hydra", "all"):
                raise UserError(f"{opt}: expected job, hydra or all, got {out.cfg!r} (e.g. --cfg job)")
        elif a == "--resolve":
            out.resolve = True
        elif a in ("-h", "--help"):
            out.help = True
        elif a in flags:
            out.flags.append(a)
        elif opt in _REFUSED_OPTIONS:
            raise UserError(f"option {opt} is not supported: {_REFUSED_OPTIONS[opt]}")
        elif a.startswith("-") and not a.startswith("~"):
            known = ["-m/--multirun", "--cfg job|hydra|all", "--resolve", "--help", *flags]
            raise UserError(f"unknown option {a} (options: {', '.join(known)}; the rest are key=value overrides)")
        else:
            out.overrides.append(a)
    if out.resolve and out.cfg is None:
        raise UserError("--resolve: only with --cfg job|hydra|all (it prints the config resolved)")
    return out


def first_point(overrides: Sequence[str]) -> tuple[list[str], bool]:
    """(``overrides`` with each sweep ``a=1,2`` / ``range(..)`` / ``choice(..)`` at its first
    value, whether there was one), read with Hydra's public override parser: the config a
    sweep's first point composes to (its ``hydra.mode`` and ``hydra.sweeper.params``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out, swept = [], False
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        if o.is_sweep_override():
            swept = True
            out.append(f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}")
        else:
            out.append(o.input_line)
    return out, swept


def resolve_all(cfg) -> None:
    """Resolve every interpolation of a composed config (e.g. a ``${oc.env:VAR}`` in an
    experiment YAML), so that one that cannot resolve is a one-line error naming its key
    here rather than a traceback from inside Hydra's job setup (``hydra.run.dir`` is
    ``${run_dir}``)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    try:
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as e:
        key = getattr(e, "full_key", None)
        raise UserError(f"{key + ': ' if key else ''}cannot resolve {describe(e)}") from e
