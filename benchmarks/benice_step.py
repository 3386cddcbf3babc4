r"""Post-training step cost: BeNice! recipes against a standard finetuning step, in one run.

  python benchmarks/benice_step.py                                # configs/benice.py:fixed
  python benchmarks/benice_step.py --config_arg=smoke --steps=5   # seconds, for a quick look
  python benchmarks/benice_step.py --variant=kv3_distill:kv_passes=3,distill_weight=1

Each variant is the trainer's own jitted step (`trainer.make_train_step`, donated state) on the
post-training stage config of `configs/benice.py:<config_arg>`: `finetune` is the standard
finetuning objective, every other variant the BeNice! objective with `benice.<field>=<value>`
overrides. Steps of all variants are timed in interleaved rounds (one step of each per round),
so load that changes during the run hits every variant alike; the table gives each median and
its ratio to finetune's median: the figure to convert post-training steps into compute.
Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import numpy as np
from absl import app, flags

from configs import benice as benice_config
from looped import model as model_lib
from looped import sharding
from looped.benice import objectives as benice_objectives
from looped.benice import stages
from looped.model.looped_lm import LoopedLM
from looped.train import objectives, optim, trainer

DEFAULT_VARIANTS = (
  "benice_kv0:kv_passes=0",
  "benice_kv3:kv_passes=3",
  "benice_kv3_distill:kv_passes=3,distill_weight=1",
)

_CONFIG_ARG = flags.DEFINE_string("config_arg", "fixed", "Arg of configs/benice.py get_config.")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed rounds (one step of every variant each).")
_VARIANT = flags.DEFINE_multi_string(
  "variant", list(DEFAULT_VARIANTS), "NAME:field=value,...: BeNice! with benice.* overrides."
)
_OUT = flags.DEFINE_string("out", "benchmarks/results/benice_step.json", "JSON output path.")


def parse_variant(spec: str) -> tuple[str, dict]:
  name, _, fields = spec.partition(":")
  overrides = {}
  for item in filter(None, fields.split(",")):
    key, sep, value = item.partition("=")
    if not sep:
      raise app.UsageError(f"--variant={spec!r}: expected NAME:field=value,...")
    overrides[key] = type(benice_config.get_config().benice[key])(value)
  if not name:
    raise app.UsageError(f"--variant={spec!r}: the variant needs a name")
  return name, overrides


def main(argv):
  del argv
  config = benice_config.get_config(_CONFIG_ARG.value)
  model = LoopedLM(model_lib.from_config(config.model))
  variants = {"finetune": None} | dict(parse_variant(v) for v in _VARIANT.value)
  mesh = sharding.make_mesh(config)
  rules = sharding.rules(config, mesh)
  b, t = config.data.batch_size, config.data.seq_len
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(0), (b, t + 1), 0, 256))
  steps, states, compile_s = {}, {}, {}
  with sharding.context(mesh, rules):
    batch = sharding.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
    for name, overrides in variants.items():
      stage = stages.FINETUNE if overrides is None else stages.BENICE
      c = stages.stage_config(config, stage)
      if overrides is None:
        objective = objectives.language_modeling(model, c.depth)
      else:
        c.benice.update(overrides)
        objective = benice_objectives.benice(model, c.depth, c.benice)
      optimizer = optim.make_optimizer(c.train)
      state = trainer.init_state(c, model, optimizer, mesh, rules)
      step = trainer.make_train_step(
        objective, optimizer, optim.learning_rate_schedule(c.train), c.train
      )
      t0 = time.perf_counter()
      steps[name] = trainer.jit_train_step(step, state).lower(state, None, batch).compile()
      compile_s[name] = time.perf_counter() - t0
      states[name], metrics = steps[name](state, None, batch)  # Warmup.
      jax.block_until_ready(metrics["loss"])
    times = {name: [] for name in variants}
    for _ in range(_STEPS.value):
      for name in variants:
        t0 = time.perf_counter()
        states[name], metrics = steps[name](states[name], None, batch)
        jax.block_until_ready(metrics["loss"])
        times[name].append(time.perf_counter() - t0)
  base = statistics.median(times["finetune"])
  rows = [
    {
      "variant": name,
      "benice_overrides": variants[name],
      "compile_s": compile_s[name],
      "step_s_median": statistics.median(ts),
      "step_s_min": min(ts),
      "finetune_steps_per_step": statistics.median(ts) / base,
      "tokens_per_s": b * t / statistics.median(ts),
    }
    for name, ts in times.items()
  ]
  print(
    f"\nconfigs/benice.py:{_CONFIG_ARG.value}  device={jax.devices()[0].device_kind}  "
    f"batch={b} seq_len={t} R={config.model.num_recurrences}  rounds={_STEPS.value}"
  )
  print("| variant | compile s | step s (median) | step s (min) | finetune steps per step |")
  print("|---|---:|---:|---:|---:|")
  for r in rows:
    print(
      f"| {r['variant']} | {r['compile_s']:.1f} | {r['step_s_median']:.3f} | "
      f"{r['step_s_min']:.3f} | {r['finetune_steps_per_step']:.2f} |"
    )
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump({"config_arg": _CONFIG_ARG.value, "rounds": _STEPS.value, "rows": rows}, f, indent=1)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
