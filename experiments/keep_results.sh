#!/usr/bin/env bash
# Copies what the docs/results.md tables are built from out of a runs directory into the repository
# (checkpoints stay behind; recorded workdirs become RUNS_DIR/...): per run, report/shareability.{json,md},
# pretrain/stage_config.json and the stage table timing.json.
#
#   bash experiments/keep_results.sh /tmp/gap_runs experiments/results/gap_sweep
#   python experiments/gap_table.py experiments/results/gap_sweep
#   python -m looped.benice.collect experiments/results/fixed_regime/*_s[0-9]
set -euo pipefail
SRC=$(cd "${1:?usage: experiments/keep_results.sh RUNS_DIR DEST_DIR}" && pwd)
DEST=${2:?usage: experiments/keep_results.sh RUNS_DIR DEST_DIR}
for run in "$SRC"/*/; do
  run=${run%/}
  [ -f "$run/report/shareability.json" ] || continue  # unfinished: nothing to keep yet
  name=$(basename "$run")
  mkdir -p "$DEST/$name/report"
  # Workdirs are recorded as absolute paths of this machine: kept relative to RUNS_DIR.
  sed "s|$SRC/|RUNS_DIR/|g" "$run/report/shareability.json" > "$DEST/$name/report/shareability.json"
  cp "$run/report/shareability.md" "$DEST/$name/report/"
  if [ -f "$run/pretrain/stage_config.json" ]; then
    mkdir -p "$DEST/$name/pretrain"
    cp "$run/pretrain/stage_config.json" "$DEST/$name/pretrain/"
  fi
  [ -f "$run/timing.json" ] && cp "$run/timing.json" "$DEST/$name/"
  echo "kept $name"
done
