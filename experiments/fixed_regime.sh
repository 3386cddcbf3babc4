#!/usr/bin/env bash
# BeNice! in the regime where fixed-depth pretraining is not KV-shareable
# (`configs/benice.py:fixed`, chosen by experiments/gap_sweep.sh; docs/results.md, "Where sharing breaks").
# Per seed: the `:fixed` pipeline (fixed-depth pretraining -> zero-shot, standard finetune and
# BeNice! with the variant's defaults), the other BeNice! settings on the same pretrained and
# finetuned models (kv_passes 0 and 3 x read `all` and `first`), and stochastic-depth pretraining
# of the same architecture (the stage-1 comparison: its zero-shot gap and contraction).
# Every run is a pipeline workdir: rerunning skips what finished and resumes what did not.
#
#   bash experiments/fixed_regime.sh /tmp/regime_runs [seeds, default "0 1"] [runs, default all]
#   bash experiments/fixed_regime.sh /tmp/regime_runs "0" "fixed kv3_first"   # a subset
#   python -m looped.benice.collect /tmp/regime_runs/*_s[0-9]
set -euo pipefail
R=${1:?usage: experiments/fixed_regime.sh RUNS_DIR [SEEDS]}
SEEDS=${2:-0 1}
RUNS=" ${3:-fixed kv0_all poisson kv0_first kv3_first} "
PY=${PYTHON:-python}
mkdir -p "$R"

# shellcheck source=experiments/pipeline_run.sh
source "$(dirname "$0")/pipeline_run.sh"

ablation() {  # ablation SEED NAME [flags...]: BeNice! only, on fixed_s<SEED>'s other stages
  local seed=$1 name=$2
  shift 2
  local b="$R/fixed_s$seed" w="$R/benice_${name}_s$seed"
  # No KV-format evaluations here (the base run has them): zero-shot and finetune are
  # re-evaluated under these eval settings (a minute each), so every report is self-contained.
  echo "== benice_${name}_s$seed ($(date))"
  "$PY" -m looped.main --config=configs/benice.py:fixed --workdir="$w" --config.seed="$seed" \
    --config.pipeline.pretrain_workdir="$b/pretrain" \
    --config.pipeline.finetune_workdir="$b/finetune" --config.eval.kv_formats="()" "$@" \
    > "$w.log" 2>&1
}

wanted() { [[ $RUNS == *" $1 "* ]]; }  # is run $1 asked for?

for seed in $SEEDS; do
  # The ablations read fixed_s<SEED>'s pretrain and finetune checkpoints: run `fixed` first.
  wanted fixed && pipeline fixed "$seed" :fixed  # BeNice! here: kv_passes 3, read `all`
  wanted kv0_all && ablation "$seed" kv0_all --config.benice.kv_passes=0  # the paper's BeNice!
  wanted poisson && pipeline poisson "$seed" :fixed,zero_shot --config.depth.sampler=poisson
  wanted kv0_first && ablation "$seed" kv0_first --config.benice.kv_passes=0 \
    --config.benice.read_recurrences=first
  if wanted kv3_first; then ablation "$seed" kv3_first --config.benice.read_recurrences=first; fi
done
