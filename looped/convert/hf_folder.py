"""A checkpoint folder in the Hugging Face layout: config.json, weights in one
`model.safetensors` or in shards listed by `model.safetensors.index.json`, and `tokenizer.json`
(with `tokenizer_config.json`, if present, naming its EOS).

Reading is split so that every problem is found before any weight is loaded: `open_folder`
reads the config and the index and checks that every shard exists; `tensor_shapes` reads only
the shards' headers; `load` reads the arrays (numpy, bfloat16 through ml_dtypes).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
from safetensors import safe_open

from looped import config_checks as cc

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # Its eos_token names the EOS (copied if present).


@dataclasses.dataclass(frozen=True)
class HFFolder:
  path: str
  config: dict  # config.json
  shards: dict  # tensor name -> shard file name (relative to path)
  tokenizer_json: str  # path of tokenizer.json ('' if absent)

  @property
  def architecture(self) -> str:
    names = self.config.get("architectures") or [""]
    return names[0] if isinstance(names, list) and names else str(names)


def _fail(path: str, why: str):
  raise cc.ConfigError(f"config.convert.source = {path!r} is invalid: {why}.")


def _read_json(path: str, what: str, source: str) -> dict:
  try:
    with open(path) as f:
      value = json.load(f)
  except OSError as e:
    _fail(source, f"{what} cannot be read ({e.strerror})")
  except json.JSONDecodeError as e:
    _fail(source, f"{what} is not JSON ({e.msg}, line {e.lineno})")
  if not isinstance(value, dict):
    _fail(source, f"{what} must hold a JSON object")
  return value


def open_folder(path: str) -> HFFolder:
  """The folder's config, its tensor -> shard map and tokenizer; ConfigError naming what is
  missing (config.json, the weights, a shard listed in the index)."""
  if not os.path.isdir(path):
    _fail(path, "must be an existing directory in the Hugging Face layout")
  config_path = os.path.join(path, CONFIG)
  if not os.path.isfile(config_path):
    _fail(path, f"it has no {CONFIG}")
  config = _read_json(config_path, CONFIG, path)
  index_path = os.path.join(path, INDEX)
  if os.path.isfile(index_path):
    weight_map = _read_json(index_path, INDEX, path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      _fail(path, f"{INDEX} has no 'weight_map'")
    shards = {str(k): str(v) for k, v in weight_map.items()}
  elif os.path.isfile(os.path.join(path, SINGLE)):
    with safe_open(os.path.join(path, SINGLE), framework="np") as f:
      shards = {name: SINGLE for name in f.keys()}
  else:
    _fail(path, f"it has neither {INDEX} nor {SINGLE}")
  for shard in sorted(set(shards.values())):
    if not os.path.isfile(os.path.join(path, shard)):
      _fail(path, f"shard {shard} listed in {INDEX} is missing")
  tokenizer = os.path.join(path, TOKENIZER)
  return HFFolder(path, config, shards, tokenizer if os.path.isfile(tokenizer) else "")


def tensor_shapes(folder: HFFolder) -> dict[str, tuple[int, ...]]:
  """{tensor name: shape} from the shards' headers (no array is read); ConfigError for a
  tensor the index lists but its shard lacks."""
  shapes = {}
  by_shard: dict[str, list[str]] = {}
  for name, shard in folder.shards.items():
    by_shard.setdefault(shard, []).append(name)
  for shard, names in sorted(by_shard.items()):
    with safe_open(os.path.join(folder.path, shard), framework="np") as f:
      present = set(f.keys())
      for name in sorted(names):
        if name not in present:
          _fail(folder.path, f"tensor {name} is listed in {INDEX} but not in shard {shard}")
        shapes[name] = tuple(int(n) for n in f.get_slice(name).get_shape())
  return shapes


def load(folder: HFFolder, names) -> dict[str, np.ndarray]:
  """The named tensors as numpy arrays, in their stored dtype."""
  out = {}
  by_shard: dict[str, list[str]] = {}
  for name in names:
    by_shard.setdefault(folder.shards[name], []).append(name)
  for shard, shard_names in sorted(by_shard.items()):
    with safe_open(os.path.join(folder.path, shard), framework="np") as f:
      for name in shard_names:
        out[name] = f.get_tensor(name)
  return out
