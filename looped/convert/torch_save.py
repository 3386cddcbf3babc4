"""Writes a state dict of numpy arrays as torch.save's zip format, without torch.

The pickle is what torch.save writes for contiguous tensors: an OrderedDict of
`torch._utils._rebuild_tensor_v2(storage, 0, shape, stride, False, OrderedDict())`, each storage a
persistent id ('storage', torch.<Type>Storage, key, 'cpu', numel) whose bytes are the zip entry
`archive/data/<key>`. torch.load (weights_only=True) and looped's reader (torch_bin.py) read it.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile

import ml_dtypes
import numpy as np

_STORAGES = {
  np.dtype(np.float32): "FloatStorage",
  np.dtype(ml_dtypes.bfloat16): "BFloat16Storage",
  np.dtype(np.float16): "HalfStorage",
}


class _Global:
  """torch's module.name, pickled as a GLOBAL opcode (torch is never imported)."""

  def __init__(self, module: str, name: str):
    self.module, self.name = module, name

  def __call__(self, *args):  # pickle asks a reduce function to be callable; never called.
    raise AssertionError("only pickled")


class _Storage:
  def __init__(self, key: str, flat: np.ndarray):
    self.key, self.flat = key, flat


class _Tensor:
  def __init__(self, storage: _Storage, shape: tuple[int, ...]):
    self.storage, self.shape = storage, shape

  def __reduce__(self):
    strides = tuple(int(s) for s in np.cumprod((1,) + self.shape[::-1])[:-1][::-1])
    rebuild = _Global("torch._utils", "_rebuild_tensor_v2")
    return rebuild, (self.storage, 0, self.shape, strides, False, collections.OrderedDict())


class _Pickler(pickle._Pickler):  # The pure-Python pickler: its dispatch table can be extended.
  dispatch = pickle._Pickler.dispatch.copy()

  def _save_global(self, obj):
    self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
    self.memoize(obj)

  dispatch[_Global] = _save_global

  def persistent_id(self, obj):
    if isinstance(obj, _Storage):
      kind = _Global("torch", _STORAGES[obj.flat.dtype])
      return ("storage", kind, obj.key, "cpu", obj.flat.size)
    return None


def save(path: str, tensors: dict[str, np.ndarray]) -> None:
  """Writes `tensors` (float32, bfloat16 or float16; one storage each) to `path`."""
  state, storages = collections.OrderedDict(), []
  for i, (name, x) in enumerate(tensors.items()):
    if x.dtype not in _STORAGES:
      raise ValueError(f"tensor {name} has dtype {x.dtype}; writable: {list(_STORAGES)}")
    storage = _Storage(str(i), np.ascontiguousarray(x).reshape(-1))
    storages.append(storage)
    state[name] = _Tensor(storage, tuple(int(d) for d in x.shape))
  buf = io.BytesIO()
  _Pickler(buf, protocol=2).dump(state)
  with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
    zf.writestr("archive/data.pkl", buf.getvalue())
    zf.writestr("archive/byteorder", "little")
    for s in storages:
      zf.writestr(f"archive/data/{s.key}", s.flat.astype(s.flat.dtype.newbyteorder("<")).tobytes())
    zf.writestr("archive/version", "3\n")
