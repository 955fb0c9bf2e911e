#!/usr/bin/env bash
# One prepared GPU benchmark run (target: under 8 minutes on one H200).
#
#   bash benchmarks/gpu.sh                 # writes benchmarks/results-gpu.json (+ .png, + .md)
#   OUT=/tmp/gpu.json bash benchmarks/gpu.sh
#
# Measures: wrapper overhead at world size 1 against the bare model (naive, bucketed,
# native, torch DDP, DataParallel; fp32), the tiny GPT's tokens/s and model-FLOPs
# utilisation in bf16 (an ~85 M-parameter config, seq 1024), and Ray Data's wait
# fraction inside a real 1-GPU training run. From a fresh clone it needs nothing else:
# without PYTHON=..., it uses .venv and, when that has no CUDA torch and the host has a
# GPU, installs one there first (torch==$TORCH_VERSION from the package index, a few GB,
# once; TORCH_INDEX_URL=... picks another index, e.g. a CUDA-specific one).
# On a host without a GPU it stops with a clear message (exit 2).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  PY=.venv/bin/python
  has_cuda_torch() { [[ -x "$PY" ]] && "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
  if ! has_cuda_torch && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu.sh: installing a CUDA build of torch==$TORCH_VERSION and this project into .venv (once)"
    [[ -x "$PY" ]] || python3 -m venv .venv
    "$PY" -m pip install -q --upgrade pip
    # --force-reinstall: a CPU build (2.13.0+cpu) also satisfies ==2.13.0
    "$PY" -m pip install -q --force-reinstall "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    "$PY" -m pip install -q -e ".[dev]" "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
  fi
  [[ -x "$PY" ]] || PY=python3
fi
OUT="${OUT:-benchmarks/results-gpu.json}"
LIMIT_S="${LIMIT_S:-470}"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" - <<'EOF'
import sys
import torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, "
      f"devices: {torch.cuda.device_count()}")
if not torch.cuda.is_available():
    print("gpu.sh: no usable CUDA torch here (no GPU, or PYTHON=... names a Python with a CPU build); "
          "on a GPU host run it without PYTHON to have .venv set up", file=sys.stderr)
    sys.exit(2)
EOF
"$PY" -c "import raytrain_ddp" 2>/dev/null || "$PY" -m pip install -q -e . --no-deps

export RAY_DEDUP_LOGS=1
export PYTHONUNBUFFERED=1
timeout --signal=INT --kill-after=20 "$LIMIT_S" \
  "$PY" -m raytrain_ddp bench --device cuda --out "$OUT" | tee "${OUT%.json}.md"
