#!/usr/bin/env bash
# The live serving study at a 1024-token context (docs/server.md, "Multi-turn sessions at a
# 1024-token context"): the `ctx1024` pipelines (the default stochastic-depth model and the
# `:fixed` regime, so what is served has a measured sharing gap), the engine's CPU cost profile
# fitted on the served model's shape at that context, then the live replay sweep of the served
# pipeline's BeNice! model over HTTP with the simulator's prediction, priced by that profile,
# beside each configuration. Pipelines resume when rerun; the fit and the sweep start over.
#
#   bash experiments/serving_live.sh /tmp/serving_runs                 # everything
#   bash experiments/serving_live.sh /tmp/serving_runs "fit sweep"     # models already trained
#   bash experiments/serving_live.sh /tmp/serving_runs mooncake        # the Mooncake replay
#
# SERVE (default `ctx1024,fixed`, the kept sweep's) names the pipeline whose model is served,
# STAGE (default `benice`) its stage: the kept sweep served `pretrain` (speed does not depend on
# the weights: outputs run to their trace length). `SERVE=ctx1024` serves the default model.
# TRAIN (default `ctx1024 ctx1024,fixed`) lists the pipelines the train step runs, TRAIN_FLAGS
# adds flags to each (the equal-quality sweep's model skipped the standard finetune arm).
# SESSIONS (a JSON object of config.sessions fields, default none) changes the session stream,
# SWEEP (default `serve_sweep`) names the sweep's output. The equal-quality sweep served the
# default model's BeNice! stage on a stream twice as fast, so bf16 pages saturate the unshared
# engine too:
#
#   TRAIN=ctx1024 TRAIN_FLAGS="--config.pipeline.models=('zero_shot','benice')" \
#     SERVE=ctx1024 SWEEP=serve_sweep_benice \
#     SESSIONS='{"session_rate_per_s": 3.0, "min_think_s": 1.0, "max_think_s": 4.0}' \
#     bash experiments/serving_live.sh /tmp/serving_runs "train sweep"
#
# `mooncake` (not in the default steps): the bundled Mooncake conversation trace scaled to the
# 1024-token model (32 tokens per 512-token block, prompts <= 960 tokens) at one budget, 3 repeats.
#
# The fit and the sweep run XLA with its default threads, as the servers do; run them on an
# otherwise idle machine, one after the other, so the profile describes the sweep's conditions.
# The fit's grid is the sweep's own call shapes: its row buckets (2, 8), token buckets (1, 16,
# 32) and page-table widths (16, 32, 64 pages of 16), chunks alone and beside decoding rows, in
# each layout and page format the sweep serves.
set -euo pipefail
R=${1:?usage: experiments/serving_live.sh RUNS_DIR [steps, default "train fit sweep"]}
STEPS=" ${2:-train fit sweep} "
PY=${PYTHON:-python}
SERVE=${SERVE:-ctx1024,fixed}
SERVED="$R/${SERVE/,/_}/${STAGE:-benice}"
SWEEP=${SWEEP:-serve_sweep}
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$R"
cd "$ROOT"

if [[ $STEPS == *" train "* ]]; then
  for variant in ${TRAIN:-ctx1024 ctx1024,fixed}; do
    w="$R/${variant/,/_}"
    echo "== pipeline $variant -> $w ($(date))"
    # shellcheck disable=SC2086
    "$PY" -m looped.main --config=configs/benice.py:$variant --workdir="$w" ${TRAIN_FLAGS:-} \
      >> "$w.log" 2>&1
  done
fi

if [[ $STEPS == *" fit "* ]]; then
  echo "== engine cost profile at 1024 positions ($(date))"
  XLA_FLAGS="" "$PY" benchmarks/engine.py --variant="$SERVE" --skip_throughput --max_model_len=1024 \
    --grid_rows 2 8 --grid_tokens 1 16 32 --grid_context 224 480 960 --grid_mixed --reps 5 \
    --grid_layouts unshared_bf16 shared_bf16 unshared_nvfp4 shared_nvfp4 \
    --hardware_out="$R/cpu_profile.json" --out="$R/engine_grid.json" > "$R/engine_grid.log" 2>&1
fi

if [[ $STEPS == *" sweep "* ]]; then
  echo "== live replay sweep ($(date))"
  "$PY" benchmarks/serve_replay.py --checkpoint="$SERVED" --trace=sessions \
    --sessions="${SESSIONS:-}" --kv_budget_bytes 3e6 5e6 8e6 --kv_formats bf16 nvfp4 --repeats=3 \
    --page_size=16 --row_buckets 2 8 --token_buckets 1 16 32 --column_buckets 16 32 64 \
    --warmup_requests=16 --no-engine_alone --hardware_json="$R/cpu_profile.json" \
    --compilation_cache="$R/serve_cache" --out="$R/$SWEEP.json" > "$R/$SWEEP.log" 2>&1
fi
if [[ $STEPS == *" mooncake "* ]]; then
  echo "== Mooncake replay ($(date))"
  "$PY" benchmarks/serve_replay.py --checkpoint="$SERVED" --trace=mooncake_conversation \
    --block_tokens=32 --max_prompt_tokens=960 --max_output_tokens=32 --num_requests=200 \
    --kv_budget_bytes 3e6 --kv_formats bf16 --repeats=3 \
    --page_size=16 --row_buckets 2 8 --token_buckets 1 16 32 --column_buckets 16 32 64 \
    --warmup_requests=16 --no-engine_alone --hardware_json="$R/cpu_profile.json" \
    --compilation_cache="$R/serve_cache" --out="$R/serve_mooncake.json" > "$R/serve_mooncake.log" 2>&1
fi
echo "== done ($(date))"
