#!/usr/bin/env bash
# DFlash, DFlash2 and EAGLE-3 trained for the same GPU-minutes on the fixture's regenerated data, then tau in the
# standard setting (24 held-out prompts, 256 + 256 tokens) at temperature 0 and 1 beside prompt lookup: every GPU
# figure of the drafter-families issue in one command (device time is scarce).
# Usage on the GPU machine: OUT=/some/dir bash benchmarks/gpu_families.sh
#   TRAIN_S (default 330): wall seconds of the three training runs, which run side by side on the one GPU (each a
#   producer and a consumer on cuda:0), so each family gets the same share of the same GPU-minutes.
#   EVAL_S (default 420): limit of the six evaluations (3 drafters x 2 temperatures), also side by side; the
#   temperature-1 rows skip the greedy reference (their speed-up is read against the T=0 run's greedy row).
set -u
OUT=${OUT:-/tmp/specring-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TOKENIZERS_PARALLELISM=false
LOG="$OUT/gpu_families.log"
T0=$(date +%s)
{ nvidia-smi -L; python3 -c 'import torch, transformers, zmq; print("torch", torch.__version__, "transformers", transformers.__version__, "zmq", zmq.__version__)'; } 2>&1 | tee -a "$LOG"
say() { echo "=== $* (t=$(( $(date +%s) - T0 ))s)" | tee -a "$LOG"; }
[ -f data/demo/heldout.arrow ] || python3 launch.py prepare --demo --no-progress > "$OUT/prepare.txt" 2>&1
say "prepare rc=$?"
REGEN=data/demo/regen.arrow
if [ ! -f $REGEN ]; then
  timeout ${REGEN_TIMEOUT_S:-200} python3 launch.py regenerate --target assets/tiny-code-lm --input data/demo/train.arrow \
    --output $REGEN --max-new-tokens 256 --prefix-len 256 --stride 256 --batch-size 1024 --devices cuda:0 --no-progress \
    > "$OUT/regen.txt" 2>&1
  say "regen rc=$?"; tail -n 5 "$OUT/regen.txt" >> "$LOG"
fi
EVAL=(--heldout data/demo/heldout.arrow --eval-prompts 4 --eval-prompt-len 256 --eval-max-new-tokens 256)
COMMON=(--producers cuda:0 --consumers cuda:0 --data $REGEN --label-source target --max-steps 100000
        --checkpoint-every ${CKPT:-500} "${EVAL[@]}")
python3 launch.py train --drafter dflash --run-dir runs/fam_dflash --target-layers 1,3,5,6,7 --lr 2e-3 "${COMMON[@]}" \
  > "$OUT/run_dflash.txt" 2>&1 & P1=$!
python3 launch.py train --drafter dflash2 --run-dir runs/fam_dflash2 --target-layers 1,3,5,6,7 --lr 2e-3 "${COMMON[@]}" \
  > "$OUT/run_dflash2.txt" 2>&1 & P2=$!
python3 launch.py train --drafter eagle3 --run-dir runs/fam_eagle3 --lr 2e-3 "${COMMON[@]}" \
  > "$OUT/run_eagle3.txt" 2>&1 & P3=$!
say "training started (dflash $P1, dflash2 $P2, eagle3 $P3)"
sleep ${TRAIN_S:-330}
kill -INT $P1 $P2 $P3 2>/dev/null   # a graceful stop: each run checkpoints and writes its summary
wait $P1 $P2 $P3
say "training stopped"
for f in dflash dflash2 eagle3; do
  echo "--- $f" >> "$LOG"; tail -n 4 "$OUT/run_$f.txt" >> "$LOG"
  python3 benchmarks/run_curves.py runs/fam_$f >> "$LOG" 2>&1
done
PIDS=()
for f in dflash dflash2 eagle3; do  # T=0 with the greedy reference (lossless check, speed-up); T=1 tau alone
  OMP_NUM_THREADS=2 timeout ${EVAL_S:-420} python3 launch.py eval --drafter runs/fam_$f --baselines prompt-lookup \
    --output-json "$OUT/eval_${f}_T0.json" > "$OUT/eval_${f}_T0.txt" 2>&1 & PIDS+=($!)
  OMP_NUM_THREADS=2 timeout ${EVAL_S:-420} python3 launch.py eval --drafter runs/fam_$f --baselines prompt-lookup \
    --temperature 1 --no-lossless-check --output-json "$OUT/eval_${f}_T1.json" > "$OUT/eval_${f}_T1.txt" 2>&1 & PIDS+=($!)
done
wait "${PIDS[@]}"
say "evaluations done"
for f in "$OUT"/eval_*.txt; do echo "--- $f" >> "$LOG"; tail -n 12 "$f" >> "$LOG"; done
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$LOG" 2>&1
tar czf "$OUT/runs.tgz" runs/fam_*/eval.jsonl runs/fam_*/metrics.jsonl runs/fam_*/summary.json "$OUT"/*.txt 2>/dev/null
say "done"
