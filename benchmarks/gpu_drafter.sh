#!/usr/bin/env bash
# GPU figures of the drafter-quality work in one command (device time is scarce): trainer throughput (fixture and
# Qwen3-8B shape, every attention form in the same run), the target-regenerated corpus, the baselines' tau in the
# standard eval setting, and short training runs per label source (run side by side on the one GPU).
# Usage on the GPU machine: OUT=/some/dir bash benchmarks/gpu_drafter.sh [steps...]
#   A schedule longer than one 10-minute device call: FINAL_STEPS=9600 FINAL_S=420 ... regen final, then on the still
#   warm machine FINAL_S=540 ... final_resume (repeat while steps remain), then ... final_eval.
#   steps: bench regen baselines sweep sweep2 final final_resume final_eval eagle3 scale ce_bench ce_pipeline recipe20
#   sweep23 eval_attention
#   peers (default: bench regen baselines
#   sweep). peers: benchmarks/peers.py (Model-Optimizer's and speculators' DFlash trainers, PEERS_MIN minutes each, the
#   wheels of .whl/ installed into /tmp/site: the device call carries .whl); PEERS=modelopt / PEERS=speculators in two
#   calls on the warm machine fit the 10-minute limit, the table accumulates in /tmp/specring-peers/results.jsonl.
set -u
OUT=${OUT:-/tmp/specring-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TOKENIZERS_PARALLELISM=false
LOG="$OUT/gpu_drafter.log"
T0=$(date +%s)
source "$(dirname "$0")/checkpoint_pack.sh"
{ nvidia-smi -L; python3 -c 'import torch, transformers, zmq; print("torch", torch.__version__, "transformers", transformers.__version__, "zmq", zmq.__version__, "gpus", torch.cuda.device_count())'; } 2>&1 | tee -a "$LOG"
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 t=$2; shift 2
  echo "=== $name (t=$(( $(date +%s) - T0 ))s): $*" | tee -a "$LOG"
  local s=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  echo "=== $name rc=$rc wall_s=$(( $(date +%s) - s ))" | tee -a "$LOG"
  grep -E "=|tau|error|Error|FAILED|wrote|speedup|prompt-lookup|dflash|greedy" "$OUT/$name.txt" | grep -v "^\s*$" | tail -n 40 >> "$LOG"
}
STEPS="${*:-bench regen baselines sweep}"
has() { [[ " $STEPS " == *" $1 "* ]]; }
[ -f data/demo/heldout.arrow ] || python3 launch.py prepare --demo --no-progress > "$OUT/prepare.txt" 2>&1; echo "prepare rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a "$LOG"

if has bench; then
  step bench_tiny 110 python3 benchmarks/trainer.py --device cuda:0 --shape tiny --seqs 8 --seq-len 1024 --num-anchors 512 \
    --steps 10 --warmup 3 --check --attention flex dense flex+compile
  step bench_qwen 100 python3 benchmarks/trainer.py --device cuda:0 --shape qwen3-8b --seqs 1 --seq-len 2048 --num-anchors 512 \
    --steps 5 --warmup 2 --check --attention flex dense
fi
ATTN_CFG=()
if [ -f "$OUT/bench_tiny.txt" ] && ! grep -q "^form=flex train_step_s" "$OUT/bench_tiny.txt"; then
  printf '[trainer]\nattention = "dense"\n' > /tmp/dense.toml; ATTN_CFG=(--config /tmp/dense.toml)
  echo "flex failed in the benchmark: the runs below use attention=dense" | tee -a "$LOG"
fi

REGEN=data/demo/regen.arrow
if has regen; then
  step regen 170 python3 launch.py regenerate --target assets/tiny-code-lm --input data/demo/train.arrow --output $REGEN \
    --max-new-tokens 256 --prefix-len 256 --stride 256 --batch-size ${REGEN_BATCH:-1024} --devices cuda:0 --no-progress &
  REGEN_PID=$!
fi
if has baselines; then
  step baselines 170 python3 launch.py eval --drafter none --num-prompts ${BASELINE_PROMPTS:-24} --output-json "$OUT/baselines.json"
fi
[ -n "${REGEN_PID:-}" ] && wait $REGEN_PID

summarize() {  # summarize RUN...: loss/accuracy/tau curves of finished runs into the log
  for r in "$@"; do
    [ -d runs/$r ] || continue
    echo "--- $r" >> "$LOG"; tail -n 4 "$OUT/run_$r.txt" >> "$LOG"
    python3 benchmarks/run_curves.py runs/$r >> "$LOG" 2>&1
  done
}
regen_summary() {  # regen_summary LABEL FILE.arrow: the regeneration's sidecar figures into the log
  python3 -c "import json, sys; m = json.load(open(sys.argv[2].replace('.arrow', '.json'))); print(sys.argv[1], \
{k: m.get(k) for k in ('num_samples', 'num_tokens', 'generated_tokens', 'seconds')})" "$1" "$2" >> "$LOG" 2>&1
}
train_for() {  # train_for NAME SECONDS FLAGS...: one launch.py train into $OUT/run_NAME.txt, SIGINT after SECONDS
  local name=$1 t=$2; shift 2
  timeout -s INT -k 120 "$t" python3 launch.py train "$@" > "$OUT/run_$name.txt" 2>&1  # SIGINT: a graceful stop
  echo "=== $name done (t=$(( $(date +%s) - T0 ))s)" | tee -a "$LOG"
}
PIDS=()  # the launch.py train runs started in the background
bg_train() {  # bg_train NAME FLAGS...: one launch.py train on cuda:0 (producer and consumer) into runs/NAME, in the background
  local name=$1; shift
  python3 launch.py train --producers cuda:0 --consumers cuda:0 --run-dir runs/$name "$@" > "$OUT/run_$name.txt" 2>&1 &
  PIDS+=($!)
}
stop_after() {  # stop_after SECONDS: SIGINT (a graceful stop) to the background runs after SECONDS, by pid, then wait
  ( sleep "$1"; kill -INT "${PIDS[@]}" 2>/dev/null ) & local killer=$!
  wait "${PIDS[@]}" 2>/dev/null; kill $killer 2>/dev/null; PIDS=()
}
EVAL=(--eval-prompts 6 --eval-prompt-len 256 --eval-max-new-tokens 256)
run() {  # run NAME STEPS EXTRA...: one launch.py train on cuda:0 (producer and consumer), in the background
  local name=$1 steps=$2; shift 2
  bg_train $name --max-steps $steps --checkpoint-every 100 "${EVAL[@]}" "${ATTN_CFG[@]}" "$@"
}
if has sweep; then
  echo "=== sweep (t=$(( $(date +%s) - T0 ))s)" | tee -a "$LOG"
  run data 300 --label-source data
  run target 300 --label-source target
  [ -f $REGEN ] && run regen 300 --label-source target --data $REGEN --heldout data/demo/heldout.arrow
  [ -f $REGEN ] && run regen_lr 300 --label-source target --data $REGEN --heldout data/demo/heldout.arrow --lr 1.5e-3
  stop_after ${SWEEP_S:-200}
  summarize data target regen regen_lr
fi
EVAL2=(--heldout data/demo/heldout.arrow --eval-prompts 4 --eval-prompt-len 256 --eval-max-new-tokens 256)
if has sweep2; then
  echo "=== sweep2 (t=$(( $(date +%s) - T0 ))s)" | tee -a "$LOG"
  S2=${SWEEP2_STEPS:-2000}
  run2() { local name=$1; shift; bg_train $name --max-steps $S2 --checkpoint-every 500 "${EVAL2[@]}" "${ATTN_CFG[@]}" \
      --data $REGEN --label-source target "$@"; }
  run2 regen_base
  run2 regen_deep --target-layers 1,3,5,6,7
  run2 regen_deep_lr --target-layers 1,3,5,6,7 --lr 2e-3
  stop_after ${SWEEP2_S:-330}
  summarize regen_base regen_deep regen_deep_lr
  BEST=$(python3 benchmarks/run_curves.py --best runs/regen_base runs/regen_deep runs/regen_deep_lr)
  echo "best=$BEST" | tee -a "$LOG"
  [ -n "$BEST" ] && step final_eval 170 python3 launch.py eval --drafter $BEST --baselines prompt-lookup \
    --output-json "$OUT/final_eval.json"
fi
if has final; then  # the recipe's training run alone on the GPU (its own evaluations in eval.jsonl)
  echo "=== final (t=$(( $(date +%s) - T0 ))s)" | tee -a "$LOG"
  train_for final ${FINAL_S:-300} --producers cuda:0,cuda:0 --consumers cuda:0 --run-dir runs/final --data $REGEN \
    --label-source target --target-layers 1,3,5,6,7 --lr 2e-3 --max-steps ${FINAL_STEPS:-3200} \
    --checkpoint-every ${FINAL_CKPT:-800} "${EVAL2[@]}" "${ATTN_CFG[@]}"
  summarize final
fi
if has final_resume; then  # a schedule longer than one device call: the next call on the same (warm) machine
  echo "=== final_resume (t=$(( $(date +%s) - T0 ))s)" | tee -a "$LOG"
  train_for final_resume ${FINAL_S:-300} --run-dir runs/final --resume
  tail -n 4 "$OUT/run_final_resume.txt" >> "$LOG"; python3 benchmarks/run_curves.py runs/final >> "$LOG" 2>&1
fi
if has final_eval; then  # the standard setting (24 held-out prompts, 256 + 256 tokens) beside prompt lookup
  step final_eval ${FINAL_EVAL_S:-300} python3 launch.py eval --drafter runs/final --baselines prompt-lookup \
    --output-json "$OUT/final_eval.json"
fi
if has eagle3; then  # a fixture EAGLE-3 drafter on the regenerated data, then tau beside prompt lookup
  echo "=== eagle3 (t=$(( $(date +%s) - T0 ))s)" | tee -a "$LOG"
  train_for eagle3 ${EAGLE3_S:-240} --producers cuda:0,cuda:0 --consumers cuda:0 --run-dir runs/eagle3 \
    --drafter eagle3 --data $REGEN --label-source target --lr ${EAGLE3_LR:-2e-3} --max-steps ${EAGLE3_STEPS:-2000} \
    --checkpoint-every ${EAGLE3_CKPT:-500} "${EVAL2[@]}"
  summarize eagle3
  step eagle3_eval ${EAGLE3_EVAL_S:-300} python3 launch.py eval --drafter runs/eagle3 --baselines prompt-lookup \
    --output-json "$OUT/eagle3_eval.json"
fi
if has scale; then  # issue 23: data at scale (every 128 tokens a prompt), drafter depth and feature noise side by side
  echo "=== scale (t=$(( $(date +%s) - T0 ))s)" | tee -a "$LOG"
  SREGEN=data/demo/regen_scale.arrow
  step regen_scale ${SCALE_REGEN_S:-420} python3 launch.py regenerate --target assets/tiny-code-lm \
    --input data/demo/train.arrow --output $SREGEN --max-new-tokens 256 --prefix-len 256 --stride ${SCALE_STRIDE:-128} \
    --batch-size ${SCALE_BATCH:-2048} --shard-size ${SCALE_SHARD:-2048} --devices cuda:0 --no-progress
  regen_summary regen_scale $SREGEN
  SEVAL=(--heldout data/demo/heldout.arrow --eval-prompts ${SCALE_EVAL_PROMPTS:-8} --eval-prompt-len 256 \
    --eval-max-new-tokens 256)
  run3() { local name=$1; shift; bg_train $name --data $SREGEN --label-source target --target-layers 1,3,5,6,7 \
      --lr 2e-3 --max-steps ${SCALE_STEPS:-4800} --checkpoint-every ${SCALE_CKPT:-1200} "${SEVAL[@]}" "$@"; }
  if [ -f $SREGEN ]; then
    run3 scale_5l
    run3 scale_2l --num-draft-layers 2
    run3 scale_2l_noise --num-draft-layers 2 --feature-noise ${SCALE_NOISE:-0.1}
    stop_after ${SCALE_S:-780}
    summarize scale_5l scale_2l scale_2l_noise
    for r in scale_5l scale_2l scale_2l_noise; do  # one at a time: the speed-ups need the GPU to themselves
      step eval_$r ${SCALE_EVAL_S:-240} python3 launch.py eval --drafter runs/$r --baselines prompt-lookup \
        --output-json "$OUT/eval_$r.json"
    done
  fi
fi
if has ce_bench; then  # issue 23/25: the head's loss at the fixture's vocabulary (8,192), fused (Liger) against chunked,
  # the recipe's batch shape (16 sequences of 512 tokens, 512 anchors each), and where a step waits for the device
  step ce_bench ${CE_BENCH_S:-240} python3 benchmarks/trainer.py --device cuda:0 --shape tiny --seqs 16 --seq-len 512 \
    --num-anchors 512 --steps 30 --warmup 5 --check --sync-debug --attention flex+compile flex+compile+fused
  grep -E "^form=|sync|positions_per_s_vs" "$OUT/ce_bench.txt" >> "$LOG"
  # measures only: a step alone does not show the pipeline's difference (docs/performance.md, "The head's loss"),
  # and fused_ce auto already picks the loss by the vocabulary
fi
if has ce_pipeline; then  # the same two losses in the recipe's pipeline (two producers and the consumer on cuda:0)
  for f in off liger; do
    train_for ce_$f ${CE_PIPE_S:-150} --producers cuda:0,cuda:0 --consumers cuda:0 --run-dir runs/ce_$f --max-steps 4000 \
      --checkpoint-every 100000 --trainer.fused-ce $f --label-source target
    grep -h "step_phases" runs/ce_$f/logs/consumer-0.log >> "$LOG"; grep "progress step" "$OUT/run_ce_$f.txt" | tail -n 1 >> "$LOG"
  done
fi
if has recipe20; then  # issue 23: the whole recipe inside 20 GPU-minutes (regenerate + train), then the standard eval
  echo "=== recipe20 (t=$(( $(date +%s) - T0 ))s)" | tee -a "$LOG"
  R20=data/demo/regen_s${R20_STRIDE:-64}.arrow; R0=$(date +%s)
  step regen_r20 ${R20_REGEN_S:-500} python3 launch.py regenerate --target assets/tiny-code-lm \
    --input data/demo/train.arrow --output $R20 --max-new-tokens 256 --prefix-len 256 --stride ${R20_STRIDE:-64} \
    --batch-size 2048 --shard-size 2048 --devices cuda:0 --no-progress
  regen_summary regen_r20 $R20
  LEFT=$(( ${R20_BUDGET_S:-1200} - ($(date +%s) - R0) ))  # training gets what regeneration left of the budget
  echo "recipe20 training budget ${LEFT}s" | tee -a "$LOG"
  train_for recipe20 $LEFT --producers cuda:0,cuda:0 --consumers cuda:0 --run-dir runs/recipe20 --data $R20 \
    --label-source target --target-layers 1,3,5,6,7 --lr 2e-3 --max-steps ${R20_STEPS:-12000} \
    --checkpoint-every ${R20_CKPT:-1500} --heldout data/demo/heldout.arrow --eval-prompts 24 --eval-prompt-len 256 \
    --eval-max-new-tokens 256 "${ATTN_CFG[@]}" ${R20_ARGS:-}
  summarize recipe20
  step recipe20_eval ${R20_EVAL_S:-300} python3 launch.py eval --drafter runs/recipe20 --baselines prompt-lookup \
    --output-json "$OUT/recipe20_eval.json"
  # the drafter itself comes back (a CPU eval of it later needs no device time)
  pack_newest_checkpoint runs/recipe20 "$OUT/recipe20_ckpt.tgz." | tee -a "$LOG"
  # one prompt at a time (z-lab's benchmark decodes batch 1): every row's speed-up without the batch's slowest row
  [ "${R20_BS1_S:-200}" != 0 ] && step recipe20_eval_bs1 ${R20_BS1_S:-200} python3 launch.py eval --drafter runs/recipe20 \
    --baselines prompt-lookup --batch-size 1 --output-json "$OUT/recipe20_eval_bs1.json"
fi
if has sweep23; then  # issue 23: where a recipe step goes (phases, torch profiler), then a sweep side by side
  echo "=== sweep23 (t=$(( $(date +%s) - T0 ))s)" | tee -a "$LOG"
  SW=data/demo/regen_s${SW_STRIDE:-128}.arrow
  [ -f $SW ] || step regen_sw ${SW_REGEN_S:-400} python3 launch.py regenerate --target assets/tiny-code-lm \
    --input data/demo/train.arrow --output $SW --max-new-tokens 256 --prefix-len 256 --stride ${SW_STRIDE:-128} \
    --batch-size 2048 --shard-size 2048 --devices cuda:0 --no-progress
  regen_summary regen_sw $SW
  RECIPE=(--data $SW --label-source target --target-layers 1,3,5,6,7 --lr 2e-3 --heldout data/demo/heldout.arrow \
    --eval-prompts 24 --eval-prompt-len 256 --eval-max-new-tokens 256)
  # the recipe alone (two producers and the consumer on cuda:0): step_phases lines and a torch-profiler window
  if [ "${PROF_S:-130}" != 0 ]; then
    SPECRING_PROFILE_STEPS=${PROF_STEPS:-600:20} train_for prof ${PROF_S:-130} --producers cuda:0,cuda:0 \
      --consumers cuda:0 --run-dir runs/prof --max-steps 12000 --checkpoint-every 1500 "${RECIPE[@]}"
    grep -h "step_phases\|profile_written\|first_step_s\|startup_s" runs/prof/logs/consumer-0.log >> "$LOG"
    head -n 60 runs/prof/profile/consumer-0.txt > "$OUT/prof_consumer.txt" 2>/dev/null
  fi
  # the sweep: each run one producer and the consumer on cuda:0, all side by side for the same wall time;
  # SW_RUNS: "NAME|FLAGS;NAME|FLAGS;..."
  run4() { local name=$1; shift; bg_train $name --max-steps ${SW_STEPS:-6000} --checkpoint-every ${SW_CKPT:-1000} \
      "${RECIPE[@]}" "$@"; }
  NAMES=()
  IFS=';' read -ra SPECS <<< "${SW_RUNS:-sw_base|;sw_tokens16k|--max-tokens 16384;sw_dpace|--trainer.loss dpace}"
  for spec in "${SPECS[@]}"; do
    name=${spec%%|*}; flags=${spec#*|}; NAMES+=("$name")
    # shellcheck disable=SC2086
    run4 "$name" $flags
  done
  stop_after ${SW_S:-420}
  summarize "${NAMES[@]}"
  for r in "${NAMES[@]}"; do
    grep -h "step_phases" runs/$r/logs/consumer-0.log | tail -n 2 >> "$LOG"
    step eval_$r ${SW_EVAL_S:-150} python3 launch.py eval --drafter runs/$r --baselines prompt-lookup \
      --output-json "$OUT/eval_$r.json"
  done
  [ "${DC_S:-150}" != 0 ] && step decode_cycle ${DC_S:-150} python3 benchmarks/decode_cycle.py \
    --drafter runs/${NAMES[0]} --num-prompts 24 --max-new-tokens 256
fi
if has eval_attention; then  # issue 25 item 4: the eval's rows with cuDNN attention (the baseline) and without
  step eval_attention ${EVAL_ATTN_S:-300} python3 benchmarks/eval_attention.py --repeats 2 -- --drafter ${EVAL_ATTN_RUN:-runs/recipe20} \
    --baselines prompt-lookup
fi
if has peers; then  # issue 23 item 5: the peers' DFlash trainers, same data and minutes, tau by launch.py eval
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/peers_install.txt" 2>&1; echo "peers wheels rc=$?" | tee -a "$LOG"
  [ -f "$OUT/final_eval.json" ] && cp "$OUT/final_eval.json" /tmp/specring-final_eval.json
  step peers ${PEERS_S:-590} env PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/peers.py run \
    --peers ${PEERS:-modelopt,speculators} --minutes ${PEERS_MIN:-5.6} $([ -f $REGEN ] && echo --data $REGEN) \
    $([ -d runs/final ] && echo --specring-run runs/final) \
    $([ -f /tmp/specring-final_eval.json ] && echo --specring-eval /tmp/specring-final_eval.json)
  cp /tmp/specring-peers/results.jsonl "$OUT/peers.jsonl" 2>/dev/null
fi
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$LOG" 2>&1
tar czf "$OUT/runs.tgz" runs/*/eval.jsonl runs/*/metrics.jsonl runs/*/summary.json runs/*/logs "$OUT"/*.txt 2>/dev/null
echo "done t=$(( $(date +%s) - T0 ))s" | tee -a "$LOG"
