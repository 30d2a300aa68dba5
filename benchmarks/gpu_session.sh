#!/usr/bin/env bash
# Every GPU figure of one device session, in one command (device time is scarce): transport, producer,
# trainer, and end-to-end launcher runs (fixture; Qwen3-8B-shaped random target) with a producer killed.
# Usage on the GPU machine: OUT=/some/dir bash benchmarks/gpu_session.sh [steps...]
set -u
OUT=${OUT:-/tmp/specring-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG="$OUT/gpu_session.log"
NG=$(python3 -c 'import torch; print(torch.cuda.device_count())')
C=$([ "$NG" -ge 2 ] && echo cuda:1 || echo cuda:0)
{ nvidia-smi -L; python3 -c 'import torch, transformers, zmq; print("torch", torch.__version__, "transformers", transformers.__version__, "zmq", zmq.__version__, "gpus", torch.cuda.device_count())'; } 2>&1 | tee -a "$LOG"
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 t=$2; shift 2
  echo "=== $name: $*" | tee -a "$LOG"
  local s=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  echo "=== $name rc=$rc wall_s=$(( $(date +%s) - s ))" | tee -a "$LOG"
  grep -E "=|tokens_per_s|GB/s|rc=" "$OUT/$name.txt" | tail -n 40 >> "$LOG"
}
STEPS="$*"
has() { [ -z "$STEPS" ] || [[ " $STEPS " == *" $1 "* ]]; }
has transport && step transport 100 python3 benchmarks/transport.py --quick
has producer && step producer 150 python3 benchmarks/producer.py --device cuda:0 --shape qwen3-8b --batches 8 --seq-len 2048 --batch-size 4 --repeats 3 --warmup 1
has trainer && step trainer 60 python3 benchmarks/trainer.py --device cuda:0 --shape qwen3-8b --seq-len 2048 --num-anchors 512 --steps 4 --warmup 2
has fixture && step e2e_fixture 230 python3 benchmarks/e2e.py --run-dir runs/gpu-fixture --kill-at-s 25 --timeout-s 220
if has qwen; then
  python3 benchmarks/random_target.py --output /tmp/qwen3-8b-random > /dev/null
  P=$([ "$NG" -ge 3 ] && echo cuda:0,cuda:2 || echo cuda:0,cuda:0)
  step e2e_qwen3_8b 340 python3 benchmarks/e2e.py --run-dir runs/gpu-qwen --kill-at-s 25 --timeout-s 330 -- --target /tmp/qwen3-8b-random \
    --random-target-weights --producers "$P" --consumers "$C" --max-tokens 16384 --max-batch-size 16 \
    --num-anchors 512 --max-steps 40 --checkpoint-every 1000 --hang-timeout-s 120
fi
cp runs/gpu-*.launcher.log "$OUT"/ 2>/dev/null; nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$LOG" 2>&1
echo "done" | tee -a "$LOG"
