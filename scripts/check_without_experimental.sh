#!/usr/bin/env bash
# The core without its experiments: copy the tracked tree (git ls-files, as committed plus
# the working tree's edits) to a temporary folder, delete mta_repro/experimental/ and
# tests/experimental/ there, and run the fast tier in the copy (PYTHONPATH and cwd = the copy).
# The installed package's entry point of an experiment then names a missing module: the
# registry may fail for it only where a config asks for that implementation, in one line.
# The docs describe the experiment and link its files: a tree that drops it for real edits
# them (the removal list in its README), so the docs' path check is not run in the copy; nor
# are pyproject.toml's import contracts, which place mta_repro.experimental among the leaves.
# Extra arguments go to pytest (e.g. -n 0); PY and TEST_WORKERS as in the Makefile.
set -euo pipefail
cd "$(dirname "$0")/.."
copy=$(mktemp -d "${TMPDIR:-/tmp}/mta_repro_core.XXXXXX")
trap 'rm -rf "$copy"' EXIT
# tracked files that exist (a deletion not yet committed is not copied)
git ls-files -z | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -cf - | tar -xf - -C "$copy"
rm -rf "$copy/mta_repro/experimental" "$copy/tests/experimental"
cd "$copy"
echo "check_without_experimental: fast tier in $copy (no mta_repro/experimental, no tests/experimental)"
PYTHONPATH="$copy" "${PY:-python3}" -m pytest -q -m "not slow" -p no:cacheprovider -x \
    -n "${TEST_WORKERS:-2}" --dist loadgroup \
    --deselect tests/test_docs_paths.py::test_every_path_and_module_a_page_names_exists \
    --deselect tests/test_house.py::test_the_import_contracts_hold "$@"
