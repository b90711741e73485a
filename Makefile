# The commands a fresh machine needs (see README):
#   make demo        install, then run the main job on the bundled default (CPU, ~3 min)
#   make test        install, then make check and the whole test suite (what .ci/run runs)
#   make test-fast   install, then ruff and the unit-level tier (the edit loop, < 3 min)
#   make check       format check, lint and types (what make test runs first)
PY ?= python3
# The CPU wheel; on a GPU cluster install your CUDA build of torch first and use
# `make TORCH= demo` to leave it alone.
TORCH ?= torch==2.13.0

# pip runs again only when pyproject.toml changed since the last install of that set of
# extras (the stamps live in pip's own egg-info folder, which git ignores); `make install`
# always runs it.
STAMPS := mta_repro.egg-info
# Said before it starts: a first install takes ~2-3 minutes, and pip -q prints nothing.
define pip_install
	@echo "make: installing $(if $(TORCH),$(TORCH) (CPU wheel) and )mta-repro[$(1)] with pip (first time ~2-3 min; later runs skip this)"
	$(if $(TORCH),$(PY) -m pip install -q $(TORCH))
	$(PY) -m pip install -q -e ".[$(1)]"
	@touch $(STAMPS)/.make-installed-$(1)
	@echo "make: installed mta-repro[$(1)]"
endef

.PHONY: install demo test test-fast lint format check
# Everything the tests touch: every extra (eval, report, wandb, hf) and the dev tools.
install:
	$(call pip_install,all$(comma)dev)

comma := ,
$(STAMPS)/.make-installed-all,dev: pyproject.toml
	$(call pip_install,all$(comma)dev)

# What the demo runs: training (wandb logs offline), evaluation and the report's plots.
$(STAMPS)/.make-installed-eval,report,wandb: pyproject.toml
	$(call pip_install,eval$(comma)report$(comma)wandb)

demo: $(STAMPS)/.make-installed-eval,report,wandb
	@echo "make demo 1/4: the paper's model sizes"
	$(PY) -m mta_repro.estimate.params --table
	@echo "make demo 2/4: train the tiny debug model (experiment=debug) on the bundled corpus (CPU, ~2 min)"
	$(PY) -m mta_repro.train experiment=debug run_dir=runs/debug
	@echo "make demo 3/4: evaluate it (eval/preset=debug: small settings, minutes)"
	$(PY) -m mta_repro.eval runs/debug eval/preset=debug
	@echo "make demo 4/4: the report (tables and figures)"
	$(PY) -m mta_repro.report runs/debug --out runs/debug/report
	@echo "make demo: done; the report is in runs/debug/report"

lint: $(STAMPS)/.make-installed-all,dev
	$(PY) -m ruff check .

# ruff format and the lint's own fixes, in place.
format: $(STAMPS)/.make-installed-all,dev
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# What CI gates on before the tests (and .pre-commit-config.yaml on each commit): the format,
# the lint rules, pyright in basic mode over the package and the import contracts (layers, no
# cycle; import-linter's lint-imports, run through $(PY)) (rules in pyproject.toml).
check: $(STAMPS)/.make-installed-all,dev
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(PY) -m pyright -p .
	$(PY) -c "from importlinter.cli import lint_imports_command; lint_imports_command()" --no-cache

# The whole suite on TEST_WORKERS pytest-xdist processes (2: this project's 2-core CI
# machine; most of the suite waits on subprocesses, the interpreter and the SLURM queue,
# not on arithmetic); --dist loadgroup keeps the SLURM tests on one worker (tests/conftest.py),
# and --no-loadscope-reorder hands the work out in the workers' collection order, which
# tests/conftest.py sorts groups and the long tier first.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: check
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=15

# Each test carries its tier marks; -m "not slow" leaves out the cluster,
# multi-rank, pipeline, Triton-interpreter and long training tests. On the same
# TEST_WORKERS processes as the whole suite (one process: 2:49 on the 2-core CI machine).
test-fast: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow" --durations=10
