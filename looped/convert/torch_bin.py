"""Reading a PyTorch `pytorch_model.bin` without torch and without running pickled code.

A `.bin` written by `torch.save` is a zip holding `<prefix>/data.pkl` (a pickle of the state
dict) and `<prefix>/data/<key>` (each storage's raw bytes). A pickle may name any global, and
unpickling calls it, so an ordinary `pickle.load` of an untrusted file runs arbitrary code.
`_Unpickler.find_class` resolves only the globals torch's tensor serialization names (the
allow-list `_ALLOWED`) to stand-ins defined here; any other global is refused in one line,
naming it, before anything is called. Storages are never executed either: a persistent id
only names a zip entry, whose bytes are read as a numpy array after checking that every
element the tensor's size, stride and offset reach lies inside it.

`read_index` records each tensor's dtype, shape, stride and offset without reading storages;
`load` reads the named tensors (numpy, bfloat16 through ml_dtypes). The legacy non-zip format
(torch < 1.6) is refused.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import pickle
import zipfile

import ml_dtypes
import numpy as np

from looped import config_checks as cc

# torch.<Name>Storage -> the numpy dtype of its elements.
_STORAGE_DTYPES = {
  "DoubleStorage": np.dtype(np.float64),
  "FloatStorage": np.dtype(np.float32),
  "HalfStorage": np.dtype(np.float16),
  "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
  "LongStorage": np.dtype(np.int64),
  "IntStorage": np.dtype(np.int32),
  "ShortStorage": np.dtype(np.int16),
  "CharStorage": np.dtype(np.int8),
  "ByteStorage": np.dtype(np.uint8),
  "BoolStorage": np.dtype(np.bool_),
}


class UnsafePickleError(cc.ConfigError):
  """The pickle names a global outside the allow-list, or is malformed (one line)."""


@dataclasses.dataclass(frozen=True)
class _StorageType:
  name: str
  dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class _StorageRef:
  key: str  # The zip entry <prefix>/data/<key>.
  dtype: np.dtype
  numel: int


@dataclasses.dataclass(frozen=True)
class TensorRef:
  """Where a tensor's elements live: a storage, an element offset and element strides."""

  storage: _StorageRef
  offset: int
  shape: tuple[int, ...]
  stride: tuple[int, ...]

  @property
  def dtype(self) -> np.dtype:
    return self.storage.dtype


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, hooks=None, *_):
  """Stands in for torch._utils._rebuild_tensor_v2: a TensorRef, bounds-checked."""
  del requires_grad, hooks
  if not isinstance(storage, _StorageRef):
    raise UnsafePickleError(f"a tensor is rebuilt from {type(storage).__name__}, not a storage")
  try:
    offset = int(storage_offset)
    shape = tuple(int(n) for n in size)
    strides = tuple(int(s) for s in stride)
  except (TypeError, ValueError) as e:
    raise UnsafePickleError(f"a tensor's offset, size or stride is malformed ({e})") from None
  if len(shape) != len(strides) or offset < 0 or min(shape + strides, default=0) < 0:
    raise UnsafePickleError(f"a tensor has size {shape}, stride {strides}, offset {offset}")
  if 0 not in shape:
    last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
    if last >= storage.numel:
      raise UnsafePickleError(
        f"a tensor of size {shape}, stride {strides}, offset {offset} reaches element {last} "
        f"of storage {storage.key}, which holds {storage.numel}"
      )
  return TensorRef(storage, offset, shape, strides)


def _rebuild_parameter(data, requires_grad=False, hooks=None, *_):
  """Stands in for torch._utils._rebuild_parameter: the tensor itself."""
  del requires_grad, hooks
  return data


# The only globals a pickle may name: (module, name) -> what it resolves to here.
_ALLOWED = {
  ("collections", "OrderedDict"): collections.OrderedDict,
  ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
  ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
  **{("torch", name): _StorageType(name, dtype) for name, dtype in _STORAGE_DTYPES.items()},
}


class _Unpickler(pickle.Unpickler):
  def find_class(self, module, name):
    if (module, name) not in _ALLOWED:
      raise UnsafePickleError(
        f"it names the global {module}.{name}, which is not among the tensor-rebuilding ones "
        "a state dict needs (nothing was run)"
      )
    return _ALLOWED[(module, name)]

  def persistent_load(self, pid):
    if (
      not isinstance(pid, tuple)
      or len(pid) != 5
      or pid[0] != "storage"
      or not isinstance(pid[1], _StorageType)
    ):
      raise UnsafePickleError(f"its persistent id {str(pid)[:80]} is not a typed storage")
    _, storage_type, key, _location, numel = pid
    if not isinstance(numel, int) or numel < 0:
      raise UnsafePickleError(f"storage {key!r} has size {numel!r}")
    return _StorageRef(str(key), storage_type.dtype, numel)


def _fail(path: str, why: str):
  raise UnsafePickleError(f"{path} cannot be read as a PyTorch checkpoint: {why}.")


def _prefix(path: str, zf: zipfile.ZipFile) -> str:
  pkls = [n for n in zf.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
  if len(pkls) != 1:
    _fail(path, f"the zip holds {len(pkls)} top-level */data.pkl entries, not 1")
  return pkls[0][: -len("data.pkl")]


def _check_byteorder(path: str, zf: zipfile.ZipFile, prefix: str) -> None:
  name = prefix + "byteorder"
  order = zf.read(name).decode().strip() if name in zf.namelist() else "little"
  if order != "little":
    _fail(path, f"its byteorder is {order!r}; only little-endian storages are read")


def read_index(path: str) -> dict[str, TensorRef]:
  """{tensor name: TensorRef} from the pickle and the zip's directory (no storage is read);
  UnsafePickleError in one line for a disallowed global, a malformed or out-of-bounds tensor, a
  storage shorter than the pickle says, or a file that is not torch's zip format."""
  if not zipfile.is_zipfile(path):
    with open(path, "rb") as f:
      head = f.read(2)
    if head[:1] == b"\x80":
      _fail(path, "it is in the legacy (torch < 1.6) format; re-save it with torch.save")
    _fail(path, "it is not a zip archive")
  with zipfile.ZipFile(path) as zf:
    prefix = _prefix(path, zf)
    _check_byteorder(path, zf, prefix)
    try:
      state = _Unpickler(io.BytesIO(zf.read(prefix + "data.pkl"))).load()
    except UnsafePickleError as e:
      _fail(path, str(e))
    except Exception as e:  # A malformed pickle: say so in one line.
      _fail(path, f"its data.pkl does not unpickle ({type(e).__name__}: {e})")
    sizes = {i.filename: i.file_size for i in zf.infolist()}
  if not isinstance(state, dict):
    _fail(path, f"it holds a {type(state).__name__}, not a state dict")
  for name, value in state.items():
    if not isinstance(name, str) or not isinstance(value, TensorRef):
      _fail(path, f"its entry {str(name)[:80]} is not a tensor")
    s = value.storage
    need = s.numel * s.dtype.itemsize
    have = sizes.get(f"{prefix}data/{s.key}")
    if have is None or have < need:
      _fail(path, f"tensor {name}'s storage {s.key} holds {have or 0} bytes, not {need}")
    if math.prod(value.shape) > max(s.numel, 1):  # An expanded view would allocate more.
      _fail(path, f"tensor {name} has more elements {value.shape} than its storage {s.numel}")
  return dict(state)


def load(path: str, refs: dict[str, TensorRef]) -> dict[str, np.ndarray]:
  """The tensors `refs` describes (from read_index of `path`), as contiguous numpy arrays."""
  out, storages = {}, {}
  with zipfile.ZipFile(path) as zf:
    prefix = _prefix(path, zf)
    _check_byteorder(path, zf, prefix)
    for name, ref in refs.items():
      s = ref.storage
      if (s.key, s.dtype) not in storages:
        data = zf.read(f"{prefix}data/{s.key}")
        if len(data) < s.numel * s.dtype.itemsize:
          _fail(path, f"storage {s.key} holds {len(data)} bytes, not {s.numel} x {s.dtype}")
        storages[(s.key, s.dtype)] = np.frombuffer(data, s.dtype, count=s.numel)
      flat = storages[(s.key, s.dtype)]
      strides = tuple(st * flat.itemsize for st in ref.stride)
      view = np.lib.stride_tricks.as_strided(
        flat[ref.offset :], ref.shape, strides, writeable=False
      )
      out[name] = np.array(view, order="C")
  return out
