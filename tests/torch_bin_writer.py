"""Writes `.bin` files in torch.save's zip layout without torch, for tests of the reader.

The pickle names torch's globals (torch._utils._rebuild_tensor_v2, torch.FloatStorage, ...) by
writing GLOBAL opcodes directly, so any global, harmful ones included, can be named.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile

import ml_dtypes
import numpy as np

STORAGE_NAMES = {
  np.dtype(np.float32): "FloatStorage",
  np.dtype(ml_dtypes.bfloat16): "BFloat16Storage",
  np.dtype(np.float16): "HalfStorage",
  np.dtype(np.int64): "LongStorage",
}


class Global:
  """A reference to module.name, pickled as a GLOBAL opcode (never imported here)."""

  def __init__(self, module: str, name: str):
    self.module, self.name = module, name

  def __call__(self, *args):
    raise AssertionError("only pickled")


class Storage:
  def __init__(self, key: str, flat: np.ndarray):
    self.key, self.flat = key, flat


class Tensor:
  """A view of `storage` as torch pickles it: (storage, offset, size, stride, grad, hooks)."""

  def __init__(self, storage: Storage, offset: int, shape, stride):
    self.storage, self.offset, self.shape, self.stride = storage, offset, shape, stride

  def __reduce__(self):
    args = (self.storage, self.offset, tuple(self.shape), tuple(self.stride), False)
    return Global("torch._utils", "_rebuild_tensor_v2"), args + (collections.OrderedDict(),)


class Call:
  """Pickles as `fn(*args)`: what a malicious checkpoint would hold."""

  def __init__(self, fn: Global, args: tuple):
    self.fn, self.args = fn, args

  def __reduce__(self):
    return self.fn, self.args


class _Pickler(pickle._Pickler):  # The pure-Python pickler, whose dispatch table can be extended.
  dispatch = pickle._Pickler.dispatch.copy()

  def _save_global_ref(self, obj):
    self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
    self.memoize(obj)

  dispatch[Global] = _save_global_ref

  def persistent_id(self, obj):
    if isinstance(obj, Storage):
      name = STORAGE_NAMES[obj.flat.dtype]
      return ("storage", Global("torch", name), obj.key, "cpu", obj.flat.size)
    return None


def write(path: str, state, storages: list[Storage], prefix: str = "archive") -> None:
  """Writes `state` (usually an OrderedDict of Tensors) and the storages' bytes."""
  buf = io.BytesIO()
  _Pickler(buf, protocol=2).dump(state)
  with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
    zf.writestr(f"{prefix}/data.pkl", buf.getvalue())
    zf.writestr(f"{prefix}/byteorder", "little")
    for s in storages:
      zf.writestr(f"{prefix}/data/{s.key}", np.ascontiguousarray(s.flat).tobytes())
    zf.writestr(f"{prefix}/version", "3\n")


def write_contiguous(path: str, tensors: dict[str, np.ndarray]) -> None:
  """A state dict of contiguous tensors, one storage each."""
  state, storages = collections.OrderedDict(), []
  for i, (name, x) in enumerate(tensors.items()):
    s = Storage(str(i), np.ascontiguousarray(x).reshape(-1))
    storages.append(s)
    strides = np.cumprod((1,) + x.shape[::-1])[:-1][::-1] if x.ndim else ()
    state[name] = Tensor(s, 0, x.shape, tuple(int(v) for v in strides))
  write(path, state, storages)
