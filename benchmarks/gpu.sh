#!/usr/bin/env bash
# One prepared GPU benchmark run (target: under 8 minutes on one H200).
#
#   bash benchmarks/gpu.sh                 # writes benchmarks/results-gpu.json (+ .png, + .md)
#   OUT=/tmp/gpu.json bash benchmarks/gpu.sh
#
# Measures: wrapper overhead at world size 1 against the bare model (naive, bucketed,
# native, torch DDP, DataParallel; fp32), the tiny GPT's tokens/s and model-FLOPs
# utilisation in bf16 (an ~85 M-parameter config, seq 1024), and Ray Data's wait
# fraction inside a real 1-GPU training run. Needs a CUDA build of torch in the Python
# it runs (default: .venv/bin/python, else python3); it never installs torch itself.
# On a host without a GPU it stops with a clear message (exit 2).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
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
    print("gpu.sh: this Python has no usable CUDA torch; install a CUDA build of torch==2.13.* first",
          file=sys.stderr)
    sys.exit(2)
EOF
"$PY" -c "import raytrain_ddp" 2>/dev/null || "$PY" -m pip install -q -e . --no-deps

export RAY_DEDUP_LOGS=1
export PYTHONUNBUFFERED=1
timeout --signal=INT --kill-after=20 "$LIMIT_S" \
  "$PY" -m raytrain_ddp bench --device cuda --out "$OUT" | tee "${OUT%.json}.md"
