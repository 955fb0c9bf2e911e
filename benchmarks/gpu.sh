#!/usr/bin/env bash
# The one prepared GPU run, for the machine as it is (torch 2.11 CUDA, no Ray, no pydantic, no
# network), from a checkout. Sections and what they measure: benchmarks/gpu_run.py, gpu_checks.py.
#
#   benchmarks/gpu.sh --prepare            # here, with an index: the missing wheels into .whl/ (git-ignored)
#   benchmarks/gpu.sh [--out DIR]          # there: results-gpu.{json,md,png} + gpu.log in DIR ($OUT if set)
#   benchmarks/gpu.sh --dry-run --out DIR  # any CPU machine: the same flow, CPU stand-ins, tiny sizes
#
# Python: the first of $PYTHON, .venv/bin/python, python3 whose torch sees CUDA (the dry run:
# whose torch imports). What it lacks (pydantic and its few dependencies; Ray cannot travel, 79 MB)
# comes from the carried wheels ($GPU_WHEELS, default .whl/), else from an index that answers
# within seconds, else it stops naming what is missing. Overall deadline: $GPU_DEADLINE_S (450 s);
# each section gets the time left. Exit 0: every section ran or was marked "not run"; 1: one failed.
set -uo pipefail
cd "$(dirname "$0")/.."

# pydantic's pins: the versions this project is tested with (pyproject: pydantic>=2.5,<3)
WHEELS_PINNED="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0"
WHEELS="${GPU_WHEELS:-.whl}"
DEVICE_PY_VERSION="${GPU_PY_VERSION:-3.12}"  # the GPU machine's python3 (device notes: 3.12.3)
mode=run
OUTDIR="${OUT:-benchmarks/gpu-out}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prepare) mode=prepare ;;
    --dry-run) mode=dry ;;
    --out) OUTDIR="$2"; shift ;;
    *) echo "gpu.sh: unknown argument '$1' (use --prepare, --dry-run, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
started=$(date +%s)
DEADLINE_S="${GPU_DEADLINE_S:-450}"
left() { echo $(( DEADLINE_S - ($(date +%s) - started) )); }

if [[ $mode == prepare ]]; then
  plats=""; for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    plats="$plats --platform $p"; done
  mkdir -p "$WHEELS"
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PY_VERSION" \
    --implementation cp $plats -d "$WHEELS" $WHEELS_PINNED || exit 1
  ls -la "$WHEELS"; echo "gpu.sh: carry '$WHEELS' with the run (device tool: carry=[\"$WHEELS\"])"
  exit 0
fi

PY=""
need_cuda=1; [[ $mode == dry ]] && need_cuda=0
probe="import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() or not $need_cuda else 1)"
for cand in "${PYTHON:-}" .venv/bin/python python3; do
  [[ -n "$cand" ]] && command -v "$cand" >/dev/null || continue
  if seen=$(timeout 120 "$cand" -c "$probe" 2>/dev/null); then PY="$cand"; break; fi
done
if [[ -z "$PY" ]]; then
  echo "gpu.sh: no usable CUDA torch: no Python here has a torch that sees CUDA (tried \$PYTHON, .venv/bin/python, python3); --dry-run runs on CPU" >&2
  exit 2
fi
echo "gpu.sh: $PY: $seen"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

SITE="${GPU_SITE:-${TMPDIR:-/tmp}/raytrain-gpu-site}"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import pydantic" 2>/dev/null; then
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "gpu.sh: installing the carried wheels from $WHEELS into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 2
  elif timeout 10 "$PY" -m pip download -q --no-deps -d "${TMPDIR:-/tmp}/gpu-probe" pydantic >/dev/null 2>&1; then
    echo "gpu.sh: an index answered: installing pydantic into $SITE"
    # shellcheck disable=SC2086
    timeout "$(left)" "$PY" -m pip install -q --target "$SITE" $WHEELS_PINNED || exit 2
  else
    echo "gpu.sh: pydantic is missing, no wheels in $WHEELS and no index answered: run 'benchmarks/gpu.sh --prepare' where pip works and carry $WHEELS" >&2
    exit 2
  fi
fi

mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=1
flags=(--out "$OUTDIR" --deadline-s "$(( $(left) - 10 ))")
[[ $mode == dry ]] && flags+=(--dry-run)
timeout --kill-after=5 "$(( $(left) ))" "$PY" -m benchmarks.gpu_run "${flags[@]}"
