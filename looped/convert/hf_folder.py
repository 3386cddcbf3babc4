"""A checkpoint folder in the Hugging Face layout: config.json, weights in one
`model.safetensors`, in shards listed by `model.safetensors.index.json`, or in one
`pytorch_model.bin` or `model.pt` (read by torch_bin.py without torch and without running
pickled code), and
`tokenizer.json` (with `tokenizer_config.json`, if present, naming its EOS).

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
from looped.convert import torch_bin

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"  # torch.save's zip format; read with an allow-list unpickler.
TORCH_PT = "model.pt"  # The same format under the name Parcae's save_pretrained writes.
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # Its eos_token names the EOS (copied if present).
SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # Copied if present (Parcae's tokenizers read it).
CHAT_TEMPLATE = "chat_template.jinja"  # Copied if present (newer transformers write it).


@dataclasses.dataclass(frozen=True)
class HFFolder:
  path: str
  config: dict  # config.json
  shards: dict  # tensor name -> shard file name (relative to path)
  tokenizer_json: str  # path of tokenizer.json ('' if absent)

  @property
  def architecture(self) -> str:
    """config.json's `architectures[0]`, else its `_class_name` (Parcae's configs)."""
    if "architectures" not in self.config and isinstance(self.config.get("_class_name"), str):
      return self.config["_class_name"]
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
    shards = {name: SINGLE for name in _safetensors_shapes(path, SINGLE)}
  elif os.path.isfile(os.path.join(path, TORCH_BIN)) or os.path.isfile(
    os.path.join(path, TORCH_PT)
  ):
    name = TORCH_BIN if os.path.isfile(os.path.join(path, TORCH_BIN)) else TORCH_PT
    shards = {t: name for t in torch_bin.read_index(os.path.join(path, name))}
  else:
    _fail(path, f"it has none of {INDEX}, {SINGLE}, {TORCH_BIN}, {TORCH_PT}")
  for shard in sorted(set(shards.values())):
    if not os.path.isfile(os.path.join(path, shard)):
      _fail(path, f"shard {shard} listed in {INDEX} is missing")
  tokenizer = os.path.join(path, TOKENIZER)
  return HFFolder(path, config, shards, tokenizer if os.path.isfile(tokenizer) else "")


def _safetensors_shapes(path: str, shard: str) -> dict[str, tuple[int, ...]]:
  """{tensor name: shape} from one shard's header; ConfigError naming the shard if it is
  truncated or not safetensors (the library's own error is a long traceback)."""
  try:
    with safe_open(os.path.join(path, shard), framework="np") as f:
      return {name: tuple(int(n) for n in f.get_slice(name).get_shape()) for name in f.keys()}
  except Exception as e:  # SafetensorError, OSError: one line naming the shard.
    _fail(path, f"shard {shard} cannot be read as safetensors ({_first_line(e)})")


def _first_line(e: Exception) -> str:
  return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def tensor_shapes(folder: HFFolder) -> dict[str, tuple[int, ...]]:
  """{tensor name: shape} from the shards' headers (no array is read); ConfigError for a
  tensor the index lists but its shard lacks, or a shard that cannot be read."""
  shapes = {}
  by_shard: dict[str, list[str]] = {}
  for name, shard in folder.shards.items():
    by_shard.setdefault(shard, []).append(name)
  for shard, names in sorted(by_shard.items()):
    if shard in (TORCH_BIN, TORCH_PT):
      present = {
        n: r.shape for n, r in torch_bin.read_index(os.path.join(folder.path, shard)).items()
      }
    else:
      present = _safetensors_shapes(folder.path, shard)
    for name in sorted(names):
      if name not in present:
        _fail(folder.path, f"tensor {name} is listed in {INDEX} but not in shard {shard}")
      shapes[name] = present[name]
  return shapes


def load(folder: HFFolder, names) -> dict[str, np.ndarray]:
  """The named tensors as numpy arrays, in their stored dtype."""
  out = {}
  by_shard: dict[str, list[str]] = {}
  for name in names:
    by_shard.setdefault(folder.shards[name], []).append(name)
  for shard, shard_names in sorted(by_shard.items()):
    path = os.path.join(folder.path, shard)
    if shard in (TORCH_BIN, TORCH_PT):
      refs = torch_bin.read_index(path)
      out.update(torch_bin.load(path, {n: refs[n] for n in shard_names}))
      continue
    try:
      with safe_open(path, framework="np") as f:
        for name in shard_names:
          out[name] = f.get_tensor(name)
    except Exception as e:  # SafetensorError, OSError: one line naming the shard.
      _fail(folder.path, f"shard {shard} cannot be read as safetensors ({_first_line(e)})")
  return out
