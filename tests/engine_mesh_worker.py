"""Runs in a subprocess with 8 fake CPU devices for tests/engine_mesh_test.py (not a test itself).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/engine_mesh_worker.py OUT.json

Serves the same requests on the engine over each mesh of MESHES (the 1-device mesh first: the
reference) in both cache layouts, and writes per engine each request's tokens and recorded
logits, and per param / page array the fraction of it each device holds, for the parent test.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from configs import pretrain
from looped.engine.engine import Engine, EngineConfig
from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.model import init_params
from looped.model.looped_lm import LoopedLM
from looped_testing import TINY_MODEL

# 8 query and 8 KV heads, MLP width 48 and vocabulary 64: every split axis divides 8.
CFG = dataclasses.replace(TINY_MODEL, vocab_size=64, num_heads=8, num_kv_heads=8, max_seq_len=48)
# 2 KV heads: split over tensor = 2, replicated over tensor = 8 (the query heads still split).
GQA = dataclasses.replace(CFG, num_kv_heads=2)
MESHES = {  # name: (data, fsdp, tensor)
  "one": (1, 1, 1),
  "tensor8": (1, 1, 8),
  "data4_tensor2": (4, 1, 2),
}
CASES = [  # (model, share_kv, meshes): pools split over 8 and 2 KV heads, and replicated.
  ("mha", True, ("one", "tensor8")),
  ("gqa", False, ("one", "tensor8", "data4_tensor2")),
]
MODELS = {"mha": CFG, "gqa": GQA}


def requests(vocab: int) -> list[GenRequest]:
  """Six prompts, four behind one 9-token prefix (prefix hits), long enough to be prefilled in
  several chunks of the 8-token step."""
  rng = np.random.default_rng(0)
  head = [int(t) for t in rng.integers(0, vocab, 9)]
  out = []
  for i in range(6):
    tail = [int(t) for t in rng.integers(0, vocab, int(rng.integers(2, 12)))]
    prompt = (head if i < 4 else []) + tail
    out.append(GenRequest(i, tuple(prompt), SamplingParams(max_new_tokens=int(3 + i % 3))))
  return out


def layout(tree) -> dict[str, dict]:
  """{path: {'fractions': of the array on each device (by device id), 'spec': its
  PartitionSpec, one entry per dimension}}."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    shards = sorted(leaf.addressable_shards, key=lambda s: s.device.id)
    spec = list(leaf.sharding.spec) + [None] * (leaf.ndim - len(leaf.sharding.spec))
    out[jax.tree_util.keystr(path)] = {
      "fractions": [s.data.size / leaf.size for s in shards],
      "spec": [list(a) if isinstance(a, tuple) else a for a in spec],
    }
  return out


def serve(cfg, params, share_kv: bool, mesh_shape) -> dict:
  engine = Engine(
    LoopedLM(cfg),
    params,
    EngineConfig(
      share_kv=share_kv,
      num_pages=14,
      page_size=4,
      max_num_batched_tokens=8,  # Prompts of up to 20 tokens: chunked prefill.
      max_num_seqs=3,
      prefill_block=8,
      row_buckets=(3,),
      token_buckets=(8,),
      column_buckets=(),
      record_logits=True,
      mesh_shape=mesh_shape,
      mesh_rules=pretrain.mesh_rules(),
    ),
  )
  gens = engine.generate(requests(cfg.vocab_size))
  ex = engine.executor
  return {
    "devices": ex.mesh.mesh.size,
    "hit_rate": engine.summary(gens)["hit_rate"],
    "tokens": [g.tokens for g in gens],
    "logits": [{str(p): v.tolist() for p, v in g.logits.items()} for g in gens],
    "params": layout(ex.params),
    "pages": layout(ex.pages),
    "most_rows": max(step["rows"] for step in ex.step_log),
    "most_tokens": max(step["tokens"] for step in ex.step_log),
  }


def main(out_path: str) -> None:
  assert jax.device_count() == 8, jax.devices()
  result = {}
  for name, share_kv, meshes in CASES:
    cfg = MODELS[name]
    params = init_params(LoopedLM(cfg), jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    for mesh in meshes:
      result[f"{name}/{'shared' if share_kv else 'unshared'}/{mesh}"] = serve(
        cfg, params, share_kv, MESHES[mesh]
      )
  with open(out_path, "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main(sys.argv[1])
