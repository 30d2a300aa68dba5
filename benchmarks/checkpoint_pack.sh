# Sourced by benchmarks/gpu_drafter.sh and benchmarks/poll_detached.sh (bash): the one way a GPU job's drafter comes
# back from the device machine.
#   pack_newest_checkpoint RUN_DIR PREFIX
# Packs RUN_DIR's newest complete checkpoint (the step directory checkpoints/latest names: the drafter's weights and
# config, without trainer_state.pt, which only a resume needs), checkpoints/latest itself and RUN_DIR's *.json /
# *.toml into a gzip tar split into 15 MiB parts PREFIX00, PREFIX01, ... (the device returns files of at most
# 16 MiB). Prints one line naming the step and the number of parts; returns 1, writing nothing, when RUN_DIR has no
# checkpoint. Layout: shared/drafters/checkpoint.py.
# Restore: mkdir -p RUN_DIR && cat PREFIX* | tar xzf - -C RUN_DIR; evaluate with launch.py eval --drafter RUN_DIR.
pack_newest_checkpoint() {
  local run=$1 prefix=$2 step
  step=$(cat "$run/checkpoints/latest" 2>/dev/null)
  [ -n "$step" ] && [ -d "$run/checkpoints/$step" ] || return 1
  rm -f "$prefix"[0-9][0-9]
  # latest is written from the step name read above, not read again: a save between the two reads cannot mismatch
  local tmp; tmp=$(mktemp -d) && mkdir "$tmp/checkpoints" && printf '%s' "$step" > "$tmp/checkpoints/latest"
  tar czf - -C "$run" --exclude trainer_state.pt "checkpoints/$step" $(cd "$run" && ls *.json *.toml 2>/dev/null) \
      -C "$tmp" checkpoints/latest | split -b 15M -d - "$prefix"
  rm -rf "$tmp"
  echo "checkpoint $step of $run in $(ls "$prefix"[0-9][0-9] | wc -l) part(s) ${prefix}NN"
}
