"""The `looped` family (`architectures: [LoopedForCausalLM]`, what export.family=looped writes) ->
LoopedLM: the folder's config.json holds the model's record and its weights are the LoopedLM
param tree under torch names, so converting back is renaming and transposing.

Names (`torch_name`): the param path under `params` with '/' -> '.', stages as the PyTorch
modules (looped/convert/hf_looped/modeling_looped.py) nest them: `prelude_<i>` ->
`model.prelude.<i>`, `recurrence/layer_<i>` -> `model.recurrence.layers.<i>`, `coda_<i>` ->
`model.coda.<i>`, other top-level params under `model.`, the untied head `lm_head.weight`; a
projection `kernel`, a norm `scale` and the embedding's `embedding` are `weight`. Values
(`to_torch`): a projection kernel [in..., out...] is torch's Linear weight [out, in] (the mixers'
output projections contract two axes, heads and head width; every other kernel one), a biased
projection's bias is flattened, everything else keeps its shape. `model.initial_state`
(state_init 'like_init': h_0 of each position, the draw LoopedLM makes) is derived from the
model, not a param, and is not read back.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from looped import config_checks as cc
from looped.convert import common
from looped.model import config as model_lib
from looped.model.looped_lm import LoopedLM, init_params

ARCHITECTURES = ("LoopedForCausalLM",)
INITIAL_STATE = "model.initial_state"
_OPTIONAL = (INITIAL_STATE,)
# config.json names of ModelConfig fields that differ: transformers' `dtype` is the weights'.
RENAMED = {"dtype": "compute_dtype"}
# Mixer modules whose output projection contracts two axes (heads, head width).
_MIXERS = ("attn", "mla", "kda")


def torch_name(path: tuple[str, ...]) -> str:
  """The weight name of the LoopedLM param at `path` (keys under 'params')."""
  head, *rest = path
  if head == "embed":
    return "model.embed.weight"
  if head == "head":
    return "lm_head.weight"
  stage = re.fullmatch(r"(prelude|coda)_(\d+)", head)
  if stage:
    parts = ["model", stage.group(1), stage.group(2)]
  elif head == "recurrence":
    sub, *rest = rest
    layer = re.fullmatch(r"layer_(\d+)", sub)
    parts = ["model", "recurrence"] + (["layers", layer.group(1)] if layer else [sub])
  else:
    parts = ["model", head]
  leaf = {"kernel": "weight", "scale": "weight", "embedding": "weight"}
  if rest:
    rest = rest[:-1] + [leaf.get(rest[-1], rest[-1])]
  return ".".join(parts + rest)


def _contracted(path: tuple[str, ...]) -> int:
  """Input axes of a projection kernel: 2 for a mixer's output projection, else 1."""
  return 2 if len(path) >= 3 and path[-2] == "out" and path[-3] in _MIXERS else 1


def to_torch(path: tuple[str, ...], x: np.ndarray) -> np.ndarray:
  """A LoopedLM param as the PyTorch model holds it."""
  if path[-1] == "kernel":
    k = _contracted(path)
    return x.reshape(math.prod(x.shape[:k]), -1).T
  if path[-1] == "bias":
    return x.reshape(-1)
  return x


def from_torch(path: tuple[str, ...], x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """to_torch undone, back to the param's `shape`."""
  if path[-1] == "kernel":
    return x.T.reshape(shape)
  return x.reshape(shape)


def _keys(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", k)) for k in path)


def abstract_params(cfg: model_lib.ModelConfig) -> dict:
  """{path: ShapeDtypeStruct} of the model's params (keys under 'params')."""
  abstract = jax.eval_shape(
    lambda: init_params(LoopedLM(cfg), jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
  )
  return {_keys(path): x for path, x in jax.tree_util.tree_leaves_with_path(abstract["params"])}


def model_config(hf: dict) -> dict:
  """The LoopedLM fields config.json records (lists as tuples); ConfigError naming a field of
  the wrong type."""
  out = {}
  for f in dataclasses.fields(model_lib.ModelConfig):
    name = RENAMED.get(f.name, f.name)
    if name not in hf:
      continue
    value = hf[name]
    if isinstance(value, list):
      value = tuple(value)
    default = f.default
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if type(value) is not type(default):
      common.unsupported(name, value, f"must be {type(default).__name__} (model.{f.name})")
    out[f.name] = value
  if not out:
    raise cc.ConfigError("config.json records no looped model field; it is not a looped export.")
  return out


def _cfg(hf: dict) -> model_lib.ModelConfig:
  return dataclasses.replace(model_lib.ModelConfig(), **model_config(hf))


def expected_shapes(hf: dict) -> tuple[dict, tuple[str, ...]]:
  """Every weight the folder must hold, with its torch shape; the optional h_0 table."""
  shapes = {}
  for path, x in abstract_params(_cfg(hf)).items():
    shapes[torch_name(path)] = to_torch(path, np.zeros(x.shape, np.int8)).shape
  return shapes, _OPTIONAL


def to_params(tensors: dict, hf: dict) -> dict:
  """LoopedLM params {'params': ...} from the folder's tensors (in their stored dtype)."""
  out: dict = {}
  for path, x in abstract_params(_cfg(hf)).items():
    common.put(
      out, "/".join(path), from_torch(path, np.asarray(tensors[torch_name(path)]), x.shape)
    )
  return {"params": out}
