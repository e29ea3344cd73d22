#!/usr/bin/env bash
# Run on a CUDA machine from the repository root (pip install -e . first).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L || true
python scripts/gpu_smoke.py
