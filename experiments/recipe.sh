#!/usr/bin/env bash
# The BeNice! recipe sweep in the `:fixed` regime (docs/benice_recipe.md).
# Per seed, `base` is the `:fixed` pipeline's baselines: fixed-depth pretraining, its zero-shot
# evaluation and standard finetuning (200 post-training steps). Every point trains BeNice! alone
# from base's pretrained model (`default`: the config's recipe; the others change one thing)
# and is compared with base's finetuned model; a `steps<N>` point trains both arms to N steps.
# Every run is a pipeline workdir: rerunning skips what finished and resumes what did not.
# VARIANT (default `:fixed`) picks another arm of configs/benice.py, e.g. `:fixed,mla`; MODEL
# holds extra flags given to every run of the call (e.g. a wider model); use one RUNS_DIR per
# VARIANT/MODEL, since points reuse that directory's base pretraining.
#
#   bash experiments/recipe.sh /tmp/recipe "0 1" "base default distill1 sd_poisson"
#   VARIANT=:fixed,mla bash experiments/recipe.sh /tmp/recipe_mla "0 1" "base default"
#   python experiments/recipe_table.py /tmp/recipe
set -euo pipefail
R=${1:?usage: experiments/recipe.sh RUNS_DIR SEEDS POINTS}
SEEDS=${2:?usage: experiments/recipe.sh RUNS_DIR SEEDS POINTS}
POINTS=${3:?usage: experiments/recipe.sh RUNS_DIR SEEDS POINTS}
PY=${PYTHON:-python}
VARIANT=${VARIANT:-:fixed}
read -r -a MODEL_FLAGS <<< "${MODEL:-}"
mkdir -p "$R"
# Cheap evaluation settings shared by every point: no KV formats, no samples (the kept
# `:fixed` reports have them); exact decode of all 128 eval rows.
EVAL=(--config.eval.kv_formats="()" --config.eval.samples=0 "${MODEL_FLAGS[@]}")

# shellcheck source=experiments/pipeline_run.sh
source "$(dirname "$0")/pipeline_run.sh"

point() {  # point SEED NAME [flags...]: BeNice! alone, from base_s<SEED>'s pretrained model
  local seed=$1 name=$2
  shift 2
  pipeline "$name" "$seed" "$VARIANT" "${EVAL[@]}" \
    --config.pipeline.pretrain_workdir="$R/base_s$seed/pretrain" \
    --config.pipeline.models='("benice",)' "$@"
}

long() {  # long SEED NAME N [flags...]: both arms at N post-training steps, base's pretraining
  local seed=$1 name=$2 n=$3
  shift 3
  pipeline "$name" "$seed" "$VARIANT" "${EVAL[@]}" \
    --config.pipeline.pretrain_workdir="$R/base_s$seed/pretrain" \
    --config.post.train.num_steps="$n" --config.post.train.checkpoint_every="$n" \
    --config.post.train.eval_every="$n" "$@"
}

for seed in $SEEDS; do
  for p in $POINTS; do
    case $p in
      base) pipeline base "$seed" "$VARIANT" "${EVAL[@]}" \
        --config.pipeline.models='("zero_shot", "finetune")' ;;
      default) point "$seed" "$p" ;;
      steps*)  # Both arms at N post-training steps (cosine schedule over N), same data order.
        long "$seed" "$p" "${p#steps}" ;;
      distill1_steps*)  # steps<N> with distillation in BeNice!'s arm.
        long "$seed" "$p" "${p#distill1_steps}" --config.benice.distill_weight=1.0 ;;
      kv0) point "$seed" "$p" --config.benice.kv_passes=0 ;;
      distill1) point "$seed" "$p" --config.benice.distill_weight=1.0 ;;
      distill1_noce) point "$seed" "$p" --config.benice.distill_weight=1.0 \
        --config.benice.shared_ce_weight=0.0 ;;
      ramp100) point "$seed" "$p" --config.benice.shared_ramp_steps=100 ;;
      kvramp100) point "$seed" "$p" --config.benice.kv_passes_ramp_steps=100 ;;
      sd_poisson) point "$seed" "$p" --config.post.depth.sampler=poisson ;;
      sd_poisson3) point "$seed" "$p" --config.post.depth.sampler=poisson \
        --config.post.depth.poisson_mean=3.0 ;;
      sd_bernoulli) point "$seed" "$p" --config.post.depth.sampler=bernoulli ;;
      sd_bernoulli9) point "$seed" "$p" --config.post.depth.sampler=bernoulli \
        --config.post.depth.survival=0.9 ;;
      uw2) point "$seed" "$p" --config.benice.unshared_ce_weight=2.0 ;;
      sw2) point "$seed" "$p" --config.benice.shared_ce_weight=2.0 ;;
      lr3e-3) point "$seed" "$p" --config.post.train.learning_rate=3e-3 ;;
      lr3e-4) point "$seed" "$p" --config.post.train.learning_rate=3e-4 ;;
      warmup100) point "$seed" "$p" --config.post.train.warmup_steps=100 ;;
      kl1) point "$seed" "$p" --config.benice.kl_weight=1.0 ;;
      distill1_uw2) point "$seed" "$p" --config.benice.distill_weight=1.0 \
        --config.benice.unshared_ce_weight=2.0 ;;
      *) echo "recipe.sh: unknown point '$p'" >&2; exit 2 ;;
    esac
  done
done
