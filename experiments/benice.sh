#!/usr/bin/env bash
# Reproduces the BeNice! experiments of docs/results.md ("BeNice! on the default model"), one run
# after another:
#   (a)+(b) 4 arms (diagonal/linear injection x Poisson/fixed-depth pretraining) x seeds, and
#   (c) BeNice! ablations on the linear fixed-depth arm (+ kv_passes=3 on the diagonal one).
# Every run is a pipeline workdir: rerunning skips what finished and resumes what did not.
#
#   bash experiments/benice.sh /tmp/benice_runs [seeds, default "0 1"]
#   python -m looped.benice.collect /tmp/benice_runs/*_s[0-9]                   # (a), (b)
#   python -m looped.benice.collect --models=benice /tmp/benice_runs/{lin_fixed,abl_lin_fixed_*}_s[0-9]
set -euo pipefail
R=${1:?usage: experiments/benice.sh RUNS_DIR [SEEDS]}
SEEDS=${2:-0 1}
PY=${PYTHON:-python}
mkdir -p "$R"

# The tables were measured with fixed-depth pretraining of the default model (diagonal
# injection, 500 steps; `--config.depth.sampler=fixed`, which is not today's `:fixed` regime) and
# exact shared decode on the first 2 eval batches (32 rows), one batch per call: pinned here,
# with the 500 pretraining steps they had (the main command now pretrains 300).
FIXED=--config.depth.sampler=fixed
EVAL=(--config.eval.decode_batches=2 --config.eval.decode_rows=16 --config.train.num_steps=500)

pipeline() {  # pipeline NAME SEED [flags...]
  local name=$1 seed=$2
  shift 2
  echo "== ${name}_s$seed ($(date))"
  "$PY" -m looped.main --config=configs/benice.py --workdir="$R/${name}_s$seed" \
    --config.seed="$seed" "${EVAL[@]}" "$@" > "$R/${name}_s$seed.log" 2>&1
}

ablation() {  # ablation BASE SEED NAME [flags...]: BeNice! only, reusing BASE's other stages
  local base=$1 seed=$2 name=$3
  shift 3
  local b="$R/${base}_s$seed" w="$R/abl_${base}_${name}_s$seed"
  # Same checkpoints and eval settings: the base run's evaluations are valid cache entries.
  mkdir -p "$w/eval" && cp -n "$b/eval/zero_shot.json" "$b/eval/finetune.json" "$w/eval/"
  echo "== abl_${base}_${name}_s$seed ($(date))"
  "$PY" -m looped.main --config=configs/benice.py --workdir="$w" --config.seed="$seed" \
    "${EVAL[@]}" "$FIXED" --config.pipeline.pretrain_workdir="$b/pretrain" \
    --config.pipeline.finetune_workdir="$b/finetune" "$@" > "$w.log" 2>&1
}

linear=--config.model.injection=linear
for seed in $SEEDS; do
  pipeline poisson "$seed"
  pipeline fixed "$seed" "$FIXED"
  pipeline lin_poisson "$seed" $linear
  pipeline lin_fixed "$seed" "$FIXED" $linear
  ablation lin_fixed "$seed" first $linear --config.benice.read_recurrences=first
  ablation lin_fixed "$seed" nounshared $linear --config.benice.unshared_ce_weight=0
  ablation lin_fixed "$seed" kl $linear --config.benice.kl_weight=1
  ablation lin_fixed "$seed" residual $linear --config.benice.residual_weight=1
  ablation lin_fixed "$seed" kv3 $linear --config.benice.kv_passes=3
  ablation fixed "$seed" kv3 --config.benice.kv_passes=3
done
