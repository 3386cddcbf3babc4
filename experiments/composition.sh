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

# shellcheck source=experiments/pipeline_run.sh
source "$(dirname "$0")/pipeline_run.sh"

for seed in $SEEDS; do
  for mixer in gqa mla kda hybrid; do
    pipeline "${mixer}_poisson" "$seed" ":$mixer"
    pipeline "${mixer}_fixed" "$seed" ":fixed,$mixer"
  done
done
