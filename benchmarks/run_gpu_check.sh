#!/usr/bin/env bash
# The device-machine entry point: install carried wheels if any, say what is installed, run the check.
#
#   bash benchmarks/run_gpu_check.sh              # writes into $OUT (the device tool's folder), else
#                                                 # benchmarks/results/
#   bash benchmarks/run_gpu_check.sh --sections ceiling,onload
#   bash benchmarks/run_gpu_check.sh --sections layers       # issue 14's layer mode alone (~1.5 min)
#   RESIDENCY_GPU_TESTS=1 bash benchmarks/run_gpu_check.sh   # also the gpu-marked tests first
#
# Wheels: the device machine has no network.  Put wheels (diffusers, accelerate, attrs and what they
# import) in .wheels/ here (see benchmarks/README.md) and carry that folder; they are installed with
# --no-deps so the machine's own CUDA torch is never replaced.
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".wheels/*.whl" > /dev/null; then
    python -m pip install --quiet --no-deps --no-index .wheels/*.whl 2>&1 | tail -3
fi
python - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu",
      torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("attrs", "accelerate", "diffusers"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:
        print(name, "unavailable:", error)
PY
if [ "${RESIDENCY_GPU_TESTS:-0}" = "1" ]; then
    # The gpu-marked tests (placement and bf16 kernels, pinned masters, no host syncs, wrapper
    # subclasses, ...): a test whose libraries are missing here is skipped by importorskip.
    mkdir -p "${OUT:-benchmarks/results}"
    timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/ \
        --junitxml="${OUT:-benchmarks/results}/gpu-tests.xml" 2>&1 | tail -25
fi
exec python -m benchmarks.gpu_check --out "${OUT:-benchmarks/results}" "$@"
