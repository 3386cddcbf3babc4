r"""Training-step throughput of the main command's three stages against this machine's matmul limit.

  python benchmarks/pipeline.py                        # configs/benice.py (the main command)
  python benchmarks/pipeline.py --config_arg=fixed     # the `:fixed` regime
  python benchmarks/pipeline.py --config_arg=smoke --rounds=3
  python benchmarks/pipeline.py --cpu_devices=1                 # one multi-threaded CPU device

Each stage is the trainer's own jitted step (`trainer.make_train_step`, donated state) on that
stage's config (`looped.benice.stages.stage_config`): pretraining with its depth sampler,
standard finetuning and BeNice! with the configured objective, on the CPU devices the main
command uses (mesh.cpu_devices). The limit is the median throughput of float32 matmuls of
--matmul_size, one per device at once (benchmarks/matmul_limit.py: warmed up, timed call by
call), measured in the same rounds, so load that changes during the run hits every row alike.
FLOPs are the matmuls the step executes (looped.model.flops: every recurrence, masked or not;
the full T x T scores).
Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import matmul_limit
import numpy as np
from absl import app, flags

from configs import benice as benice_config
from looped import model as model_lib
from looped import sharding, startup
from looped.benice import objectives as benice_objectives
from looped.benice import stages
from looped.model import flops
from looped.model.looped_lm import LoopedLM
from looped.train import objectives, optim, trainer

_CONFIG_ARG = flags.DEFINE_string("config_arg", "", "Arg of configs/benice.py get_config.")
_ROUNDS = flags.DEFINE_integer("rounds", 15, "Timed rounds (one step of every stage each).")
_MATMUL = flags.DEFINE_integer("matmul_size", 1024, "n of the n x n x n float32 limit matmul.")
_CPU_DEVICES = flags.DEFINE_integer(
  "cpu_devices", None, "CPU devices (default: what the main command picks, mesh.cpu_devices)."
)
_OUT = flags.DEFINE_string("out", "benchmarks/results/pipeline.json", "JSON output path.")


def _stage_step(config, stage: str, model: LoopedLM, mesh, rules, batch):
  """(compiled step, initial state, compile seconds, FLOPs per token) of one stage."""
  c = stages.stage_config(config, stage)
  if stage == stages.BENICE:
    objective = benice_objectives.benice(model, c.depth, c.benice)
    per_token = flops.benice_flops_per_token(model.cfg, c.data.seq_len, c.benice.kv_passes)
  else:
    objective = objectives.language_modeling(model, c.depth)
    per_token = flops.train_flops_per_token(model.cfg, c.data.seq_len)
  optimizer = optim.make_optimizer(c.train)
  state = trainer.init_state(c, model, optimizer, mesh, rules)
  step = trainer.make_train_step(
    objective, optimizer, optim.learning_rate_schedule(c.train), c.train
  )
  t0 = time.perf_counter()
  compiled = trainer.jit_train_step(step, state).lower(state, None, batch).compile()
  return compiled, state, time.perf_counter() - t0, per_token


def main(argv):
  del argv
  config = benice_config.get_config(_CONFIG_ARG.value)
  if _CPU_DEVICES.value is not None:
    config.mesh.cpu_devices = _CPU_DEVICES.value
  startup.use_cpu_devices(config, distributed=False)  # As `python -m looped.main` does.
  model = LoopedLM(model_lib.from_config(config.model))
  mesh = sharding.make_mesh(config)
  rules = sharding.rules(config, mesh)
  b, t = config.data.batch_size, config.data.seq_len
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(0), (b, t + 1), 0, 256))
  matmul = matmul_limit.MatmulLimit(mesh, _MATMUL.value)
  n, devices = _MATMUL.value, matmul.devices
  steps, states, compile_s, per_token = {}, {}, {}, {}
  with sharding.context(mesh, rules):
    batch = sharding.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
    for stage in stages.STAGES:
      steps[stage], states[stage], compile_s[stage], per_token[stage] = _stage_step(
        config, stage, model, mesh, rules, batch
      )
      states[stage], metrics = steps[stage](states[stage], None, batch)  # Warmup.
      jax.block_until_ready(metrics["loss"])
    times = {name: [] for name in stages.STAGES}
    for _ in range(_ROUNDS.value):
      for stage in stages.STAGES:
        t0 = time.perf_counter()
        states[stage], metrics = steps[stage](states[stage], None, batch)
        jax.block_until_ready(metrics["loss"])
        times[stage].append(time.perf_counter() - t0)
      matmul.measure(repeats=5, warmup=5)
  limit = matmul.flops_per_s()
  rows = []
  for stage in stages.STAGES:
    step_s = statistics.median(times[stage])
    achieved = per_token[stage] * b * t / step_s
    rows.append(
      {
        "stage": stage,
        "compile_s": compile_s[stage],
        "step_s_median": step_s,
        "step_s_min": min(times[stage]),
        "tokens_per_s": b * t / step_s,
        "gflop_per_step": per_token[stage] * b * t / 1e9,
        "gflops_per_s": achieved / 1e9,
        "fraction_of_matmul_limit": achieved / limit,
      }
    )
  print(
    f"\nconfigs/benice.py:{_CONFIG_ARG.value}  device={jax.devices()[0].device_kind} "
    f"x{jax.device_count()}  batch={b} seq_len={t} R={config.model.num_recurrences}  "
    f"rounds={_ROUNDS.value}  matmul limit ({n}^3 float32): {limit / 1e9:.1f} GFLOP/s"
  )
  print(
    "| stage | compile s | step s (median) | tokens/s | GFLOP/step | GFLOP/s | of matmul limit |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(
      f"| {r['stage']} | {r['compile_s']:.1f} | {r['step_s_median']:.3f} | "
      f"{r['tokens_per_s']:.0f} | {r['gflop_per_step']:.1f} | {r['gflops_per_s']:.1f} | "
      f"{r['fraction_of_matmul_limit']:.1%} |"
    )
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(
      {
        "config_arg": _CONFIG_ARG.value,
        "rounds": _ROUNDS.value,
        "matmul_size": n,
        "devices": devices,
        "matmul_limit_gflops": limit / 1e9,
        "versions": {"jax": jax.__version__},
        "rows": rows,
      },
      f,
      indent=1,
    )
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
