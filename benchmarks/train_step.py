r"""Training-step speed of the scanned looped model vs the Python-unrolled one (same FLOPs).

  python benchmarks/train_step.py                       # default pretrain model, CPU
  python benchmarks/train_step.py --config_arg=smoke --steps=20
  python benchmarks/train_step.py --preset=350m --dtype=bfloat16   # on a GPU

Reports compile time, median step time, tokens/s, model FLOPs utilisation against --peak_tflops
(when given) and XLA's compiled memory estimate (arguments + temporaries), for each variant.
Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from configs import pretrain
from looped.model import LoopedLM, from_config
from looped.train import objectives, optim

_CONFIG_ARG = flags.DEFINE_string("config_arg", "", "Arg for configs/pretrain.py get_config.")
_PRESET = flags.DEFINE_enum("preset", None, ["350m"], "Model preset overriding the config.")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Compute dtype override.")
_BATCH = flags.DEFINE_integer("batch", None, "Global batch override.")
_SEQ = flags.DEFINE_integer("seq_len", None, "Sequence length override.")
_RECURRENCES = flags.DEFINE_integer("num_recurrences", None, "R override (compile-time scaling).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per variant (after one warmup step).")
_PEAK = flags.DEFINE_float("peak_tflops", 0.0, "Accelerator peak TFLOP/s for MFU (0: skip).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/train_step.json", "JSON output path.")


def _config():
  config = pretrain.get_config(_CONFIG_ARG.value)
  config.depth.sampler = "fixed"  # Same FLOPs every step, for a fair comparison.
  if _PRESET.value == "350m":
    m = config.model
    m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 1024, 16, 4, 64, 4096
    m.num_prelude_layers, m.num_core_layers, m.num_coda_layers = 4, 10, 4
    m.num_recurrences, m.vocab_size, m.max_seq_len = 4, 32768, 2048
    m.tie_embeddings = False
    config.data.seq_len, config.data.batch_size = 2048, 16
  if _DTYPE.value:
    config.model.dtype = _DTYPE.value
  if _BATCH.value:
    config.data.batch_size = _BATCH.value
  if _RECURRENCES.value:
    config.model.num_recurrences = _RECURRENCES.value
  if _SEQ.value:
    config.data.seq_len = _SEQ.value
    config.model.max_seq_len = max(config.model.max_seq_len, _SEQ.value)
  return config


def model_flops_per_token(cfg, seq_len: int) -> float:
  """Forward+backward FLOPs per token: 6 x matmul params applied + attention (PaLM-style)."""
  d, hd = cfg.d_model, cfg.head_dim
  attn = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
  mlp = d * cfg.mlp_dim * (3 if cfg.mlp_type == "swiglu" else 2)
  per_layer = attn + mlp
  applied_layers = cfg.num_prelude_layers + cfg.num_coda_layers
  applied_layers += cfg.num_core_layers * cfg.num_recurrences
  inject = {"diagonal": d * d, "linear": 2 * d * d, "additive": 0}[cfg.injection]
  matmul_params = applied_layers * per_layer + cfg.num_recurrences * inject + d * cfg.vocab_size
  attention = applied_layers * 2 * cfg.num_heads * hd * seq_len  # QK^T and PV, causal half x2
  return 6 * matmul_params + 6 * attention


def _bench_variant(config, scan: bool) -> dict:
  config = config.copy_and_resolve_references()
  config.model.scan_recurrences = scan
  cfg = from_config(config.model)
  model = LoopedLM(cfg)
  objective = objectives.language_modeling(model, config.depth)
  optimizer = optim.make_optimizer(config.train)
  b, t = config.data.batch_size, config.data.seq_len
  tokens = jax.random.randint(jax.random.PRNGKey(0), (b, t + 1), 0, cfg.vocab_size)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  params = {"params": model.init(jax.random.PRNGKey(1), batch["inputs"][:1])["params"]}
  opt_state = optimizer.init(params)

  def step(params, opt_state, batch, key):
    (loss, _), grads = jax.value_and_grad(objective.loss_fn, has_aux=True)(params, None, batch, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return jax.tree.map(jnp.add, params, updates), opt_state, loss

  key = jax.random.PRNGKey(2)
  t0 = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, batch, key).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  peak_bytes = None
  if mem is not None:
    peak_bytes = int(mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes)
  params, opt_state, loss = compiled(params, opt_state, batch, key)
  jax.block_until_ready(loss)
  times = []
  for i in range(_STEPS.value):
    t0 = time.perf_counter()
    params, opt_state, loss = compiled(params, opt_state, batch, jax.random.fold_in(key, i))
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)
  tokens_per_s = b * t / step_s
  flops = model_flops_per_token(cfg, t) * b * t
  row = {
    "variant": "scan" if scan else "unrolled",
    "compile_s": compile_s,
    "step_s_median": step_s,
    "step_s_min": min(times),
    "tokens_per_s": tokens_per_s,
    "model_tflops_per_s": flops / step_s / 1e12,
    "xla_memory_bytes": peak_bytes,
    "params": int(sum(x.size for x in jax.tree.leaves(params))),
    "final_loss": float(loss),
  }
  if _PEAK.value:
    row["mfu"] = flops / step_s / (_PEAK.value * 1e12)
  return row


def main(argv):
  del argv
  config = _config()
  rows = [_bench_variant(config, scan) for scan in (True, False)]
  header = {
    "device": str(jax.devices()[0].device_kind),
    "backend": jax.default_backend(),
    "batch": config.data.batch_size,
    "seq_len": config.data.seq_len,
    "dtype": config.model.dtype,
    "model": config.model.to_dict(),
  }
  cols = ["variant", "compile_s", "step_s_median", "tokens_per_s", "model_tflops_per_s"]
  cols += ["xla_memory_bytes"] + (["mfu"] if _PEAK.value else [])
  print(
    f"\ndevice={header['device']} batch={header['batch']} seq_len={header['seq_len']} "
    f"R={config.model.num_recurrences} dtype={config.model.dtype}"
  )
  print(f"params={rows[0]['params']:,}")
  print("| " + " | ".join(cols) + " |")
  print("|" + "---|" * len(cols))
  for row in rows:
    cells = []
    for c in cols:
      v = row[c]
      cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
    print("| " + " | ".join(cells) + " |")
  ratio = rows[1]["step_s_median"] / rows[0]["step_s_median"]
  print(f"unrolled/scan step-time ratio: {ratio:.3f}")
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump({"setup": header, "rows": rows, "unrolled_over_scan": ratio}, f, indent=2)
  print(f"wrote {_OUT.value}")
  np.testing.assert_allclose(rows[0]["final_loss"], rows[1]["final_loss"], rtol=1e-3)


if __name__ == "__main__":
  app.run(main)
