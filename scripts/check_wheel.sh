#!/usr/bin/env bash
# The wheel works without the clone: build it (python -m build --wheel), install it with the
# eval, report, hf and wandb extras into a fresh venv, and run the README's commands from
# a folder outside the clone, PYTHONPATH unset, so that every config, SLURM template and
# bundled file comes from the installed package (mta_repro/resources.py). CI runs it
# (.ci/run); docs/install.md says how to install a wheel.
#
#   scripts/check_wheel.sh                 everything, in a temporary folder removed at the end
#   KEEP=1 scripts/check_wheel.sh          keep the folder (its path is printed)
#   PY=python3.11 TORCH=torch==2.13.0 ...  the interpreter and the torch pin (TORCH= : none
#                                          first; pip then takes what the package's range allows)
#
# Checks, besides every command's exit status: the package imported is the installed one,
# the runs record no git commit (a wheel is no checkout) and nothing is written into the
# installed package. Needs `build` (the dev extra) and the package registry (or pip's cache).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-python3}
TORCH=${TORCH-torch==2.13.0}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mta-wheel.XXXXXX")
if [ "${KEEP:-0}" = 1 ]; then
  echo "check_wheel: working in $WORK (kept)"
else
  trap 'rm -rf "$WORK"' EXIT
fi
T0=$SECONDS
step() {
  echo "check_wheel: $*"
  local t=$SECONDS
  # explicit: errexit does not apply inside a function called before || (the build below)
  "$@" || {
    local rc=$?
    echo "check_wheel: FAILED (exit $rc): $*" >&2
    return $rc
  }
  echo "check_wheel:   ok in $((SECONDS - t))s"
}

# The clone's build/ and egg-info folders are ignored by git; the wheel lands in $WORK.
# Without `build` (the dev extra), pip builds the same wheel through the same backend.
# (from $WORK: in the clone, its build/ folder would pass for the module)
cd "$WORK"
if "$PY" -c "import build.__main__" 2>/dev/null; then
  BUILD=("$PY" -m build --wheel --outdir "$WORK/dist" "$REPO")
else
  echo "check_wheel: no 'build' module for $PY (pip install build, or the dev extra); using pip wheel"
  BUILD=("$PY" -m pip wheel --no-deps --wheel-dir "$WORK/dist" "$REPO")
fi
step "${BUILD[@]}" >"$WORK/build.log" 2>&1 || {
  tail -30 "$WORK/build.log"
  exit 1
}
WHEEL=$(ls "$WORK"/dist/mta_repro-*.whl)
step "$PY" -m venv "$WORK/venv"
V="$WORK/venv/bin/python"
if [ -n "$TORCH" ]; then step "$V" -m pip install -q "$TORCH"; fi
step "$V" -m pip install -q "$WHEEL[eval,report,hf,wandb]"

mkdir "$WORK/run"
cd "$WORK/run"
unset PYTHONPATH
# No hub in CI: the commands run on what the wheel bundles (as `make demo` does offline).
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SITE=$("$V" -c 'import mta_repro, pathlib; print(pathlib.Path(mta_repro.__file__).parent)')
case "$SITE" in
  "$WORK/venv/"*) ;;
  *) echo "check_wheel: mta_repro imported from $SITE, not the venv" >&2; exit 1 ;;
esac
snapshot() { (cd "$SITE" && find . -path '*/__pycache__' -prune -o -type f -print0 | sort -z | xargs -0 sha256sum); }
snapshot >"$WORK/site.before"

# make demo's four steps, as the README gives them
step "$V" -m mta_repro.estimate.params --table
step "$V" -m mta_repro.train experiment=debug run_dir=runs/debug
step "$V" -m mta_repro.eval runs/debug eval/preset=debug
step "$V" -m mta_repro.report runs/debug --out runs/debug/report
test -s runs/debug/report/report.md || { echo "check_wheel: no runs/debug/report/report.md" >&2; exit 1; }
# the README's other commands, at their smallest
step "$V" -m mta_repro.eval.generate runs/debug --prompt "Once upon a time" --max-new-tokens 8
step "$V" -m mta_repro.estimate model=880m attention=mta
step "$V" -m mta_repro.estimate experiment=pretrain_880m_mta --memory
step "$V" -m mta_repro.pipeline.submit experiment=debug --dry-run
step "$V" -m mta_repro.eval.submit runs/debug --dry-run
step "$V" -m mta_repro.pipeline pipeline=tiny root=runs/tiny
step "$V" -m mta_repro.hf export runs/debug hf/debug
step "$V" -m mta_repro.hf import hf/debug imported.pt

"$V" - <<'EOF'
import json
from pathlib import Path

from mta_repro.runs.provenance import RECORD

def codes(node):
    """Every "code" record (package, commit, dirty), wherever the provenance keeps it."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from [value] if key == "code" else codes(value)
    elif isinstance(node, list):
        for value in node:
            yield from codes(value)


found = list(codes(json.loads((Path("runs/debug") / RECORD).read_text())))
assert found and all(c["commit"] is None and c["package"] for c in found), found
print("check_wheel: runs/debug records", found[-1])
EOF
snapshot >"$WORK/site.after"
if ! diff -u "$WORK/site.before" "$WORK/site.after"; then
  echo "check_wheel: the commands wrote into the installed package ($SITE)" >&2
  exit 1
fi
echo "check_wheel: the wheel ran every command from $WORK/run in $((SECONDS - T0))s"
