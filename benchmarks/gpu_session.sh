#!/usr/bin/env bash
# Every GPU figure of docs/performance.md, in one command (device time is scarce): transport, producer (Qwen3-8B
# shape; a Qwen3.5-shaped hybrid target with flash-linear-attention against the torch fallback), trainer (Qwen3-8B
# shape, with Liger Kernel's fused linear + cross-entropy against the chunked loss), the fused loss's GPU test, and
# end-to-end launcher runs (fixture; Qwen3-8B-shaped random target) with a producer killed.
# Usage on the GPU machine: OUT=/some/dir bash benchmarks/gpu_session.sh [steps...] (default: every step)
#   steps: transport producer producer_hybrid linear_ce trainer trainer_fused eagle3_step first_step eval_batched
#          fixture qwen regen
#   env: FIRST_NAME/FIRST_FLAGS/FIRST_STEPS/FIRST_S (first_step), FUSED_NAME/ANCHORS/FORMS/PROFILE/FUSED_S
#   (trainer_fused): a name per call keeps the outputs of several calls apart in $OUT.
#   Wheels in .whl/ (pyzmq, flash-linear-attention, fla-core, liger-kernel: the machine has no index) are
#   installed into /tmp/site first.
set -u
OUT=${OUT:-/tmp/specring-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
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
has producer_hybrid && step producer_hybrid ${HYBRID_S:-200} python3 benchmarks/producer.py --device cuda:0 \
  --shape qwen3.5-27b --num-layers 16 --batches 4 --seq-len 2048 --batch-size 2 --repeats 2 --warmup 1 \
  --compare-linear-attention
has linear_ce && step linear_ce 120 python3 -m pytest -q -p no:cacheprovider tests/unit/test_linear_ce.py
has trainer && step trainer 60 python3 benchmarks/trainer.py --device cuda:0 --shape qwen3-8b --seq-len 2048 --num-anchors 512 --steps 4 --warmup 2
has trainer_fused && step ${FUSED_NAME:-trainer_fused} ${FUSED_S:-240} python3 benchmarks/trainer.py --device cuda:0 --shape qwen3-8b \
  --seq-len 2048 --num-anchors ${ANCHORS:-512} --steps 5 --warmup 2 --check --profile ${PROFILE:-0} ${TRACE:+--trace $TRACE} ${SYNC_DEBUG:+--sync-debug} \
  --attention ${FORMS:-flex+compile+fused flex+compile flex+fused flex}
has eagle3_step && step eagle3_step 200 python3 benchmarks/eagle3_step.py --device cuda:0 \
  --forms batched+compile batched reference --check --profile 2
if has first_step; then  # a fixture run on the GPU: spawn -> first step, tau evaluated off the training path
  # FIRST_NAME names the run (runs/gpu-$FIRST_NAME, $OUT/$FIRST_NAME*), FIRST_FLAGS adds launch.py train flags
  # (e.g. FIRST_FLAGS="--trainer.warm-up blocking"): two calls with their own names compare in one session
  FN=${FIRST_NAME:-first_step}; FD=runs/gpu-${FN//_/-}
  [ -f data/demo/heldout.arrow ] || python3 launch.py prepare --demo --no-progress > "$OUT/prepare.txt" 2>&1
  rm -rf "$FD"
  step "$FN" ${FIRST_S:-240} python3 launch.py train --run-dir "$FD" --producers cuda:0 \
    --consumers cuda:0 --max-steps ${FIRST_STEPS:-600} --checkpoint-every 200 --eval-every 200 ${FIRST_FLAGS:-}
  python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(sys.argv[2], {k: v for k, v in s.items() if any(w in k for w in ("first", "start", "spawn", "eval", "tau", "elapsed", "steps_per", "tokens_per"))})' \
    "$FD/summary.json" "$FN" >> "$LOG" 2>&1
  grep -hE "warm_up|startup_s|compile" "$FD"/logs/*.log 2>/dev/null | tail -n 12 >> "$LOG"
  cp "$FD/summary.json" "$OUT/${FN}_summary.json" 2>/dev/null
  cp "$FD/eval.jsonl" "$OUT/${FN}_eval.jsonl" 2>/dev/null
fi
if has eval_batched; then  # the standard setting (24 held-out prompts, 256 + 256, bf16): batched, then one at a time
  D=${EVAL_DRAFTER:-runs/gpu-first-step}
  step eval_batched 200 python3 launch.py eval --drafter $D --baselines prompt-lookup --output-json "$OUT/eval_batched.json"
  step eval_loop ${LOOP_S:-330} python3 launch.py eval --drafter $D --baselines prompt-lookup --batch-size 1 \
    --output-json "$OUT/eval_loop.json"
fi
has fixture && step e2e_fixture 230 python3 benchmarks/e2e.py --run-dir runs/gpu-fixture --kill-at-s 25 --timeout-s 220
if has qwen; then
  python3 benchmarks/random_target.py --output /tmp/qwen3-8b-random > /dev/null
  P=$([ "$NG" -ge 3 ] && echo cuda:0,cuda:2 || echo cuda:0,cuda:0)
  step e2e_qwen3_8b 340 python3 benchmarks/e2e.py --run-dir runs/gpu-qwen --kill-at-s 25 --timeout-s 330 -- --target /tmp/qwen3-8b-random \
    --random-target-weights --producers "$P" --consumers "$C" --max-tokens 16384 --max-batch-size 16 \
    --num-anchors 512 --max-steps 40 --checkpoint-every 1000 --hang-timeout-s 120
fi
has regen && step regen 300 python3 benchmarks/regenerate.py --device cuda --num-prompts 4096 --batch-size 1024 \
  --forms dynamic static static:2048 static:4096
cp runs/gpu-*.launcher.log "$OUT"/ 2>/dev/null; nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$LOG" 2>&1
echo "done" | tee -a "$LOG"
