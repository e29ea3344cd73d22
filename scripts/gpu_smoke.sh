#!/usr/bin/env bash
# On a CUDA machine, from an installed checkout (pip install -e .): the GPU smoke test, the runner
# benchmark on the GPU (random weights with the real models' shapes) and the tests that need CUDA.
# OUT_DIR (default results/gpu) gets gpu_smoke.json, runner_cuda.json and a log of each part.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-results/gpu}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 SSD_SKIP_REAL_MODEL=1
PY=${PYTHON:-python3}
nvidia-smi -L || true
"$PY" scripts/gpu_smoke.py "$OUT_DIR" 2>&1 | tee "$OUT_DIR/gpu_smoke.log"
smoke=${PIPESTATUS[0]}
bench=0
if [ "${SSD_GPU_BENCH:-1}" = 1 ]; then  # SSD_GPU_BENCH=0: checks only
    "$PY" benchmarks/runner.py --device cuda --random-weights --modes bf16,bf16-eager,int8,int4 \
        --out "$OUT_DIR/runner_cuda.json" 2>&1 | tee "$OUT_DIR/runner_cuda.log"
    bench=${PIPESTATUS[0]}
fi
"$PY" -m pytest -q -p no:cacheprovider -rs -k "cuda or non_cpu" tests/test_cuda_graphs.py tests/test_kernels.py \
    tests/test_quant.py tests/test_hugepages.py \
    2>&1 | tee "$OUT_DIR/gpu_pytest.log"
tests=${PIPESTATUS[0]}
echo "smoke=$smoke bench=$bench tests=$tests"
[ "$smoke" = 0 ] && [ "$bench" = 0 ] && [ "$tests" = 0 ]
