#!/usr/bin/env bash
# The composition table of issue 13 (README "Mixers"): BeNice! with GQA, MLA, KDA and the KDA:MLA
# hybrid, each pretrained with stochastic depth (the default) and in the `:fixed` regime (fixed
# depth, linear injection, no prelude/coda: the arm with a sharing gap; there the hybrid is its
# core's KDA + MLA alone), x seeds. Every pipeline run trains and evaluates zero-shot, standard finetune and
# BeNice!, each also with bf16 / fp8 / mxfp8 / nvfp4 caches (config.eval.kv_formats).
# Every run is a pipeline workdir: rerunning skips what finished and resumes what did not.
#
#   bash experiments/composition.sh /tmp/composition_runs [seeds, default "0 1"]
#   python -m looped.benice.collect /tmp/composition_runs/*_s[0-9]
#   python experiments/composition_memory.py        # KV memory per token vs bf16 unshared GQA
#
# Not yet run (README "Mixers"): about 8x the main command's time per seed on 2 CPU cores.
set -euo pipefail
R=${1:?usage: experiments/composition.sh RUNS_DIR [SEEDS]}
SEEDS=${2:-0 1}
PY=${PYTHON:-python}
mkdir -p "$R"

pipeline() {  # pipeline NAME SEED CONFIG_ARG [flags...]
  local name=$1 seed=$2 arg=$3
  shift 3
  echo "== ${name}_s$seed ($(date))"
  "$PY" -m looped.main --config="configs/benice.py$arg" --workdir="$R/${name}_s$seed" \
    --config.seed="$seed" "$@" > "$R/${name}_s$seed.log" 2>&1
}

for seed in $SEEDS; do
  for mixer in gqa mla kda hybrid; do
    pipeline "${mixer}_poisson" "$seed" ":$mixer"
    pipeline "${mixer}_fixed" "$seed" ":fixed,$mixer"
  done
done
