#!/usr/bin/env bash
# The gap sweep of docs/results.md: where does fixed-depth pretraining stop being KV-shareable?
# Fixed-depth pretraining of the default model, one factor changed at a time from the base
# (diagonal injection, decay 0.5 at init, QK-norm, like_init h_0, R = 4, 500 steps, seed 0),
# then the zero-shot shareability evaluation of each (exact shared decode gap with its 95% CI over
# all 128 eval rows, K/V drift across recurrences). A point `a+b` combines the factors a and b.
# Every run is a workdir: rerunning skips finished runs and resumes interrupted ones.
#
#   bash experiments/gap_sweep.sh /tmp/gap_runs            # train + evaluate every point
#   bash experiments/gap_sweep.sh /tmp/gap_runs "lin+zeros+noqk"   # one combination
#   python -m looped.benice.collect /tmp/gap_runs/*/       # one table
set -euo pipefail
R=${1:?usage: experiments/gap_sweep.sh RUNS_DIR [POINTS]}
POINTS=${2:-base lin add decay95 noqk zeros r8 steps1500 steps3000}
PY=${PYTHON:-python}
mkdir -p "$R"

flags_of() {  # the config overrides of one sweep point (factors joined by +)
  local factor
  for factor in ${1//+/ }; do factor_flags "$factor"; done | tr '\n' ' '
}

factor_flags() {
  case $1 in
    base) echo "" ;;
    lin) echo "--config.model.injection=linear" ;;
    add) echo "--config.model.injection=additive" ;;
    decay95) echo "--config.model.diagonal_decay_init=0.95" ;;
    noqk) echo "--config.model.qk_norm=False" ;;
    zeros) echo "--config.model.state_init=zeros" ;;
    r8) echo "--config.model.num_recurrences=8" ;;
    p0c0) echo "--config.model.num_prelude_layers=0 --config.model.num_coda_layers=0" ;;
    steps1500) echo "--config.train.num_steps=1500" ;;
    steps3000) echo "--config.train.num_steps=3000" ;;
    *) echo "unknown sweep factor $1" >&2; exit 2 ;;
  esac
}

for point in $POINTS; do
  flags=$(flags_of "$point")
  echo "== $point ($(date)) $flags"
  # shellcheck disable=SC2086
  "$PY" -m looped.main --config=configs/benice.py:zero_shot --workdir="$R/$point" \
    --config.depth.sampler=fixed --config.seed=0 --config.eval.decode_batches=8 --config.eval.decode_rows=128 $flags \
    > "$R/$point.log" 2>&1
done
