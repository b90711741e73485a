#!/usr/bin/env bash
# A GPU machine image without a package registry (Python 3.12, torch 2.11, Triton 3.6) as a supported platform, checked on this CPU machine:
#
#   scripts/check_versions.sh image     a venv with only the image's packages (torch CPU
#                                       standing in for its 2.11+cu130) plus the wheels of
#                                       scripts/device_wheels.sh, installed --no-index: the
#                                       trainer's command line trains 2 steps and
#                                       gpu_acceptance.py --quick --device cpu passes
#   scripts/check_versions.sh kernels   the Triton kernels under the image's Triton 3.6.0:
#                                       the interpreter tests (TRITON_INTERPRET=1) and the
#                                       sm_90 compile report of the experimental fused
#                                       kernels (mta_repro.experimental.fused_triton.compile_report)
#   scripts/check_versions.sh           both
#   scripts/check_versions.sh hf        the HF export under the oldest transformers the `hf`
#                                       extra allows (TRANSFORMERS_VERSION, default 4.45.0):
#                                       tests/test_hf.py and tests/test_hf_cache.py, slow tier
#                                       included, in a venv ($HF_VENV, default .venv-hf/) over
#                                       this interpreter's packages with that transformers
#                                       (and the tokenizers/huggingface_hub it pins) on top
#
# KERNEL_TESTS (pytest -k expression, default: all of both kernel test files) narrows the
# interpreter tests; COMPILE_ARGS the compile (default: every layer and pass at T=2048;
# COMPILE=0 skips it: minutes on 2 cores); ACCEPTANCE=0 skips the acceptance run of `image`.
# The venv lives in $CHECK_VENV (default .venv-check/, git-ignored) and is reused.
# Needs a package registry (PyPI) for the venv. tests/test_device_image.py runs `image`
# and the kernels' first tests (the slow tier), with torch 2.13's CPU wheel.
# TORCH_VERSION=2.11.0 checks the image's own torch: PyPI has it only as a CUDA build
# (with its nvidia-* libraries a 4.7 GB venv, minutes to install), which runs on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHAT=${1:-all}
VENV=${CHECK_VENV:-.venv-check}
PY=${PY:-python3}
TRITON_VERSION=${TRITON_VERSION:-3.6.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
# What the image has that the trainer, the acceptance script and the tests import.
IMAGE_PACKAGES=("torch==$TORCH_VERSION" numpy pyyaml packaging tqdm sentencepiece tiktoken safetensors
                "triton==$TRITON_VERSION" pytest)
say() { echo "check_versions.sh: $*" >&2; }

venv() {
  if [[ ! -x $VENV/bin/python ]] || ! "$VENV/bin/python" -c "import torch, triton, sys; sys.exit(triton.__version__ != '$TRITON_VERSION' or not torch.__version__.startswith('$TORCH_VERSION'))" 2>/dev/null; then
    say "building $VENV (no system packages): ${IMAGE_PACKAGES[*]}"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "${IMAGE_PACKAGES[@]}"
    local pyver
    pyver=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    PYVER=$pyver scripts/device_wheels.sh "$VENV/wheels" >/dev/null
    # As on the device: the missing packages from the carried wheels only, no registry.
    "$VENV/bin/python" -m pip install -q --no-index --find-links "$VENV/wheels" \
      hydra-core omegaconf antlr4-python3-runtime zstandard
  fi
  "$VENV/bin/python" -c "import torch, triton; print(f'check_versions.sh: torch {torch.__version__}, triton {triton.__version__}')" >&2
}

image() {
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  say "image: the trainer's command line, 2 steps"
  PYTHONPATH=$ROOT "$VENV/bin/python" -m mta_repro.train experiment=debug run_dir="$tmp/run" trainer.steps=2 \
    trainer.eval_every=0 logging.wandb_mode=disabled checkpoint.export=false
  test -f "$tmp/run/checkpoints/0000000002/.complete"
  if [[ ${ACCEPTANCE:-1} == 1 ]]; then
    say "image: gpu_acceptance.py --quick --device cpu"
    env -u TRITON_INTERPRET PYTHONPATH="$ROOT" "$VENV/bin/python" scripts/gpu_acceptance.py --quick --device cpu \
      --out "$tmp/acceptance"
  fi
  say "image: ok"
}

kernels() {
  say "kernels: interpreter tests under Triton $TRITON_VERSION${KERNEL_TESTS:+ (-k $KERNEL_TESTS)}"
  TRITON_INTERPRET=1 PYTHONPATH=$ROOT "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_kq_conv_triton.py tests/experimental/test_attn_triton.py ${KERNEL_TESTS:+-k "$KERNEL_TESTS"}
  if [[ ${COMPILE:-1} == 1 ]]; then
    say "kernels: sm_90 compile report under Triton $TRITON_VERSION"
    # shellcheck disable=SC2086
    PYTHONPATH=$ROOT "$VENV/bin/python" -m mta_repro.experimental.fused_triton.compile_report ${COMPILE_ARGS:---seqs 2048}
  fi
  say "kernels: ok"
}

hf() {
  local v=${HF_VENV:-.venv-hf} tf=${TRANSFORMERS_VERSION:-4.45.0}
  if ! "$v/bin/python" -c "import transformers, sys; sys.exit(transformers.__version__ != '$tf')" 2>/dev/null; then
    say "building $v: this interpreter's packages + transformers==$tf"
    rm -rf "$v"
    "$PY" -m venv --system-site-packages "$v"
    # datasets 4.x+ needs huggingface_hub >= 1, which transformers 4.x refuses: the datasets
    # of that era comes along (lm-eval's --model hf test imports it).
    "$v/bin/python" -m pip install -q "transformers==$tf" ${HF_EXTRA_PACKAGES-"datasets<4"}
  fi
  "$v/bin/python" -c "import transformers, tokenizers; print(f'check_versions.sh: transformers {transformers.__version__}, tokenizers {tokenizers.__version__}')" >&2
  PYTHONPATH=$ROOT "$v/bin/python" -m pytest -q -p no:cacheprovider tests/test_hf.py tests/test_hf_cache.py \
    ${HF_TESTS:+-k "$HF_TESTS"}
  say "hf: ok"
}

case $WHAT in
  image) venv; image ;;
  kernels) venv; kernels ;;
  all) venv; image; kernels ;;
  hf) hf ;;
  *) say "unknown check '$WHAT' (image, kernels, hf or nothing for image and kernels)"; exit 2 ;;
esac
