# The two commands a fresh machine needs (see README):
#   make demo   install, then run the main job on the bundled default (CPU, minutes)
#   make test   install, then run the test suite (what .ci/run runs)
PY ?= python3
# The CPU wheel; on a GPU cluster install your CUDA build of torch first and use
# `make TORCH= demo` to leave it alone.
TORCH ?= torch==2.13.0

.PHONY: install demo test
install:
	$(if $(TORCH),$(PY) -m pip install -q $(TORCH))
	$(PY) -m pip install -q -e ".[dev,hf]"

demo: install
	$(PY) -m mta_repro.params --table
	$(PY) -m mta_repro.train experiment=debug run_dir=runs/debug
	$(PY) -m mta_repro.eval runs/debug eval/preset=debug
	$(PY) -m mta_repro.report runs/debug --out runs/debug/report

test: install
	$(PY) -m pytest -q --durations=15
