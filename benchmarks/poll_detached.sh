#!/usr/bin/env bash
# Poll a GPU job started detached on the device machine (benchmarks/gpu_drafter.sh with OUT=/tmp/gout, from a copy
# of the checkout in /tmp/proj), in a device call that carries nothing:
#   bash benchmarks/poll_detached.sh [WAIT_S=560] [JOB_OUT=/tmp/gout] [PROJ=/tmp/proj]
# Waits up to WAIT_S seconds for the script's last line (`done t=...`), then packs everything the job wrote so
# far (JOB_OUT, and the runs' records: metrics.jsonl, eval.jsonl, summary.json, logs/) into $OUT/poll.tgz, so a
# machine lost before the next poll loses only what came after this one; prints the log's tail.
# The newest checkpoint of runs/$POLL_RUN (default recipe20: its weights and config, not trainer_state.pt) comes
# back too, as $OUT/ckpt.tgz.00, .01, ... (15 MiB parts: the device returns files of at most 16 MiB), so a lost
# machine still leaves a drafter to evaluate (benchmarks/checkpoint_pack.sh). Restore:
#   mkdir -p runs/recipe20 && cat ckpt.tgz.* | tar xzf - -C runs/recipe20
source "$(dirname "$0")/checkpoint_pack.sh"
W=${1:-560}; JOB_OUT=${2:-/tmp/gout}; PROJ=${3:-/tmp/proj}
s=$(date +%s)
while [ $(( $(date +%s) - s )) -lt "$W" ]; do
  grep -q "^done t=" "$JOB_OUT/gpu_drafter.log" 2>/dev/null && break
  sleep 10
done
( cd "$PROJ" 2>/dev/null && tar czf "$OUT/poll.tgz" \
    $(ls -d runs/*/metrics.jsonl runs/*/eval.jsonl runs/*/summary.json runs/*/logs 2>/dev/null) -C / "${JOB_OUT#/}" )
pack_newest_checkpoint "$PROJ/runs/${POLL_RUN:-recipe20}" "$OUT/ckpt.tgz."
tail -n 15 "$JOB_OUT/gpu_drafter.log" 2>/dev/null
for f in "$PROJ"/runs/*/eval.jsonl; do [ -f "$f" ] && { echo "--- $f"; tail -n 3 "$f"; }; done
