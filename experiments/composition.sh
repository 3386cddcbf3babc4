#!/usr/bin/env bash
# The composition table of docs/results.md ("Mixers: the composition table"): BeNice! with GQA, MLA, KDA and the KDA:MLA
# hybrid, each pretrained with stochastic depth (the default, `<mixer>_poisson`) and in the
# `:fixed` regime (fixed depth, linear injection, no prelude/coda: the arm with a sharing gap;
# there the hybrid is its core's KDA + MLA alone, `<mixer>_fixed`), x seeds. Every pipeline trains
# and evaluates zero-shot, standard finetune and BeNice!, each also with bf16 / fp8 / nvfp4 caches,
# at the `composition` scale of configs/benice.py (300 pretraining + 100 post-training steps,
# exact decode on 32 rows; 17-19 min per GQA or MLA pipeline on one CPU core, KDA 35-45 min).
# Every run is a pipeline workdir: rerunning skips what finished and resumes what did not.
#
#   bash experiments/composition.sh /tmp/composition_runs [seeds, default "0 1"] [runs, default all]
#   taskset -c 0 bash experiments/composition.sh /tmp/comp "0" "kda_fixed gqa_fixed" &  # a subset
#   python -m looped.benice.collect /tmp/composition_runs/*_s[0-9]
#   python experiments/composition_memory.py        # KV memory per token vs bf16 unshared GQA
set -euo pipefail
R=${1:?usage: experiments/composition.sh RUNS_DIR [SEEDS] [RUNS]}
SEEDS=${2:-0 1}
ALL="gqa_fixed mla_fixed kda_fixed hybrid_fixed gqa_poisson mla_poisson kda_poisson hybrid_poisson"
RUNS=${3:-$ALL}
PY=${PYTHON:-python}
mkdir -p "$R"

# shellcheck source=experiments/pipeline_run.sh
source "$(dirname "$0")/pipeline_run.sh"

for seed in $SEEDS; do
  for run in $RUNS; do
    mixer=${run%_*}
    case "$run" in
      gqa_fixed | mla_fixed | kda_fixed | hybrid_fixed) arm=",fixed" ;;
      gqa_poisson | mla_poisson | kda_poisson | hybrid_poisson) arm="" ;;
      *) echo "unknown run '$run'; known: $ALL" >&2 && exit 2 ;;
    esac
    # A failed run (its log says why) does not stop the others; the exit status reports it.
    pipeline "$run" "$seed" ":composition$arm,$mixer" || failed="$failed ${run}_s$seed"
  done
done
if [ -n "${failed:-}" ]; then
  echo "failed:$failed (see $R/<run>.log; rerunning resumes them)" >&2
  exit 1
fi
