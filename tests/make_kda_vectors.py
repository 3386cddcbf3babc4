"""Writes tests/testdata/kda_vectors.npz: flash-linear-attention's naive KDA on random inputs.

  python -m venv /tmp/venv_fla && /tmp/venv_fla/bin/pip install torch flash-linear-attention
  /tmp/venv_fla/bin/python tests/make_kda_vectors.py      # needs torch, einops, numpy only

CI installs no torch: tests/kda_test.py compares looped.model.kda against the committed file,
and also runs `reference` live when fla is importable.

Reference: fla.ops.kda.naive (fla 0.6.0) `naive_recurrent_kda` and `naive_chunk_kda` (chunk
64), with an initial state and the final state returned. fla.ops.kda's package __init__ imports
triton kernels, so naive.py (torch + einops only) is loaded from its file.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

B, T, H, K, V = 2, 128, 2, 16, 8  # T: two chunks of 64 (naive_chunk_kda needs T % 64 == 0).
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata", "kda_vectors.npz")


def fla_naive():
  """fla/ops/kda/naive.py as a module, or None when fla (or torch) is not installed."""
  try:
    spec = importlib.util.find_spec("fla")
  except (ImportError, ValueError):
    return None
  if spec is None or not spec.submodule_search_locations:
    return None
  path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "kda", "naive.py")
  if not os.path.exists(path):
    return None
  try:
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
  except ImportError:
    return None
  return module


def inputs(seed: int) -> dict[str, np.ndarray]:
  """Inputs as KDA's layer produces them: L2-normalized q, k; log decays g < 0 from
  -exp(A_log) softplus(.) with A_log in [log 1, log 16]; beta = sigmoid(.); a random state."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  unit = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
  a_log = np.log(rng.uniform(1.0, 16.0, (H, 1))).astype(np.float32)
  g = -np.exp(a_log) * np.logaddexp(0.0, normal(B, T, H, K) - 4.0)  # softplus
  return {
    "q": unit(normal(B, T, H, K)),
    "k": unit(normal(B, T, H, K)),
    "v": normal(B, T, H, V),
    "g": g.astype(np.float32),
    "beta": (1 / (1 + np.exp(-normal(B, T, H)))).astype(np.float32),
    "state": normal(B, H, K, V),
  }


def reference(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  import torch

  naive = fla_naive()
  t = {name: torch.from_numpy(a) for name, a in x.items()}
  args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
  out = {}
  o, s = naive.naive_recurrent_kda(*args, initial_state=t["state"], output_final_state=True)
  out["recurrent_o"], out["recurrent_state"] = o.numpy(), s.numpy()
  o, s = naive.naive_chunk_kda(
    *args, initial_state=t["state"], output_final_state=True, chunk_size=64
  )
  out["chunk_o"], out["chunk_state"] = o.numpy(), s.numpy()
  return out


def main():
  x = inputs(seed=0)
  ref = reference(x)
  np.savez_compressed(OUT, **{f"in/{k}": v for k, v in x.items()}, **ref)
  print(f"wrote {OUT}")


if __name__ == "__main__":
  main()
