#!/usr/bin/env bash
# Wheels for a GPU machine image that has no package registry (docs/gpu.md): the packages the
# trainer and scripts/gpu_acceptance.py import that the image lacks (read off such machines
# in 2026-11: Python 3.12.3, torch 2.11.0+cu130, Triton 3.6.0, transformers, tiktoken,
# sentencepiece, safetensors, PyYAML, numpy, tqdm, pytest; no Hydra, OmegaConf, ANTLR's
# runtime or zstandard). Run it here (a registry), then carry wheels/ with the device command
# (docs/gpu.md, section 1):
#
#   scripts/device_wheels.sh            # -> wheels/ (git-ignored)
#   scripts/device_wheels.sh OUT_DIR
#
# Binary wheels for CPython $PYVER (3.12) on x86-64 Linux; ANTLR's 4.9.3 runtime (the one OmegaConf
# 2.3 needs) exists only as a source archive, so it is built here into a pure-Python wheel.
# Versions are those this repository is tested with. tests/test_device_image.py installs
# them with --no-index into a venv that has only the image's packages and imports the trainer.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-wheels}
PY=${PY:-python3}
# The image's Python; PYVER=3.11 makes the same set for this machine's (the test's venv).
PYVER=${PYVER:-3.12}
ABI=cp${PYVER/./}
mkdir -p "$OUT"
BINARY=(hydra-core==1.3.8 omegaconf==2.3.1 zstandard==0.25.0)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp --abi "$ABI" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --dest "$OUT" "${BINARY[@]}"
# Pure Python, source only on PyPI: a py3-none-any wheel runs on 3.12 as on this Python.
"$PY" -m pip wheel -q --no-deps --wheel-dir "$OUT" antlr4-python3-runtime==4.9.3
ls -1 "$OUT"
