"""The `.bin` reader on files written here in torch.save's zip layout (no torch): contents
round trip exactly, views keep their offset and strides, a disallowed global is refused in one
line before anything runs; and an unreadable safetensors shard is one line naming it."""

import collections
import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import safetensors.numpy
import torch_bin_writer as tbw
from absl.testing import absltest

import looped_testing as testing
from looped import config_checks
from looped.convert import hf_folder, torch_bin

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Dirs(testing.TempDirTestCase):
  def _dir(self) -> str:
    """A fresh directory under self.tmp."""
    import tempfile

    return tempfile.mkdtemp(dir=self.tmp)


class TorchBinTest(_Dirs):
  def test_round_trip_dtypes(self):
    rng = np.random.default_rng(0)
    tensors = {
      "f32": rng.normal(size=(3, 5)).astype(np.float32),
      "bf16": rng.normal(size=(4, 2, 3)).astype(ml_dtypes.bfloat16),
      "f16": rng.normal(size=(7,)).astype(np.float16),
      "scalar": np.array(2.5, np.float32),
    }
    path = os.path.join(self._dir(), "pytorch_model.bin")
    tbw.write_contiguous(path, tensors)
    refs = torch_bin.read_index(path)
    self.assertEqual(
      {n: r.shape for n, r in refs.items()}, {n: x.shape for n, x in tensors.items()}
    )
    got = torch_bin.load(path, refs)
    for name, x in tensors.items():
      self.assertEqual(got[name].dtype, x.dtype, name)
      np.testing.assert_array_equal(
        got[name].reshape(-1).view(np.uint8), x.reshape(-1).view(np.uint8), err_msg=name
      )

  def test_views_keep_offset_and_strides(self):
    # Two tensors share one storage: a transposed view at offset 3 and a strided slice.
    flat = np.arange(40, dtype=np.float32) * 0.5
    s = tbw.Storage("0", flat)
    state = collections.OrderedDict(
      t=tbw.Tensor(s, 3, (4, 5), (1, 4)),  # element [i, j] = flat[3 + i + 4 j]
      every_third=tbw.Tensor(s, 1, (6,), (3,)),
    )
    path = os.path.join(self._dir(), "pytorch_model.bin")
    tbw.write(path, state, [s])
    got = torch_bin.load(path, torch_bin.read_index(path))
    want_t = np.array([[flat[3 + i + 4 * j] for j in range(5)] for i in range(4)])
    np.testing.assert_array_equal(got["t"], want_t)
    np.testing.assert_array_equal(got["every_third"], flat[1:17:3])
    self.assertTrue(got["t"].flags.c_contiguous)

  def test_out_of_bounds_view_is_refused(self):
    s = tbw.Storage("0", np.zeros(10, np.float32))
    path = os.path.join(self._dir(), "pytorch_model.bin")
    tbw.write(path, collections.OrderedDict(x=tbw.Tensor(s, 2, (3, 4), (4, 1))), [s])
    with self.assertRaisesRegex(torch_bin.UnsafePickleError, r"reaches element 13 of storage 0"):
      torch_bin.read_index(path)
    # A stride-0 (expanded) view inside the storage that would allocate far more than it.
    tbw.write(path, collections.OrderedDict(x=tbw.Tensor(s, 0, (10**6,), (0,))), [s])
    with self.assertRaisesRegex(torch_bin.UnsafePickleError, r"more elements"):
      torch_bin.read_index(path)

  def test_short_storage_is_refused_before_reading(self):
    s = tbw.Storage("0", np.zeros(10, np.float32))
    path = os.path.join(self._dir(), "pytorch_model.bin")
    # The pickle says 12 elements; the zip entry holds 10.
    s_big = tbw.Storage("0", np.zeros(12, np.float32))
    tbw.write(path, collections.OrderedDict(x=tbw.Tensor(s_big, 0, (3, 4), (4, 1))), [s])
    with self.assertRaisesRegex(
      torch_bin.UnsafePickleError, r"tensor x's storage 0 holds 40 bytes, not 48"
    ):
      torch_bin.read_index(path)

  def _malicious(self, fn: tbw.Global, marker: str) -> str:
    """A .bin whose state dict holds fn(...) that would create `marker` if run."""
    s = tbw.Storage("0", np.zeros(4, np.float32))
    if fn.name == "system":
      args = (f"touch {marker}",)
    else:
      args = (f"open({marker!r}, 'w').close()",)
    state = collections.OrderedDict(w=tbw.Tensor(s, 0, (4,), (1,)), b=tbw.Call(fn, args))
    path = os.path.join(self._dir(), "pytorch_model.bin")
    tbw.write(path, state, [s])
    return path

  def test_disallowed_global_is_refused_before_running(self):
    for module, name in (("os", "system"), ("builtins", "eval")):
      marker = os.path.join(self._dir(), "ran")
      path = self._malicious(tbw.Global(module, name), marker)
      with self.assertRaises(config_checks.ConfigError) as e:
        torch_bin.read_index(path)
      msg = str(e.exception)
      self.assertIn(f"names the global {module}.{name}", msg)
      self.assertIn(path, msg)
      self.assertNotIn("\n", msg)
      self.assertFalse(os.path.exists(marker), f"{module}.{name} ran")

  def test_payload_runs_under_plain_pickle(self):
    # The proof above means something only if the payload does run when unpickled normally.
    import pickle
    import zipfile

    marker = os.path.join(self._dir(), "ran")
    path = self._malicious(tbw.Global("builtins", "eval"), marker)
    with zipfile.ZipFile(path) as zf:
      data = zf.read("archive/data.pkl")

    class Permissive(pickle.Unpickler):
      def find_class(self, module, name):
        if module.startswith("torch"):
          return lambda *a: None
        return super().find_class(module, name)

      def persistent_load(self, pid):
        return None

    Permissive(__import__("io").BytesIO(data)).load()
    self.assertTrue(os.path.exists(marker))

  def test_legacy_and_non_zip_are_refused(self):
    d = self._dir()
    legacy = os.path.join(d, "legacy.bin")
    with open(legacy, "wb") as f:
      f.write(b"\x80\x02\x8a\x0a" + b"\0" * 16)
    with self.assertRaisesRegex(torch_bin.UnsafePickleError, "legacy"):
      torch_bin.read_index(legacy)


def _folder(path: str, weights: dict, hf: dict | None = None) -> str:
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf or {"architectures": ["RavenForCausalLM"]}, f)
  for name, write in weights.items():
    write(os.path.join(path, name))
  return path


class FolderTest(_Dirs):
  def test_folder_reads_pytorch_model_bin(self):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    path = _folder(
      self._dir(),
      {hf_folder.TORCH_BIN: lambda p: tbw.write_contiguous(p, {"a.weight": x})},
    )
    folder = hf_folder.open_folder(path)
    self.assertEqual(hf_folder.tensor_shapes(folder), {"a.weight": (2, 3)})
    np.testing.assert_array_equal(hf_folder.load(folder, ["a.weight"])["a.weight"], x)

  def test_truncated_safetensors_is_one_line_naming_the_shard(self):
    tensors = {"a.weight": np.ones((64, 64), np.float32)}
    for shard in ("model-00001-of-00002.safetensors", hf_folder.SINGLE):
      path = self._dir()
      file = os.path.join(path, shard)
      safetensors.numpy.save_file(tensors, file)
      with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
      if shard != hf_folder.SINGLE:
        with open(os.path.join(path, hf_folder.INDEX), "w") as f:
          json.dump({"weight_map": {"a.weight": shard}}, f)
      with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["RavenForCausalLM"]}, f)
      with self.assertRaises(config_checks.ConfigError) as e:
        hf_folder.tensor_shapes(hf_folder.open_folder(path))
      self.assertIn(f"shard {shard} cannot be read as safetensors", str(e.exception))
      self.assertNotIn("\n", str(e.exception))

  def test_command_line_errors_are_one_line(self):
    d = self._dir()
    marker = os.path.join(d, "ran")
    s = tbw.Storage("0", np.zeros(4, np.float32))
    state = collections.OrderedDict(
      w=tbw.Tensor(s, 0, (4,), (1,)), b=tbw.Call(tbw.Global("os", "system"), (f"touch {marker}",))
    )
    bad_bin = _folder(
      os.path.join(d, "bin"), {hf_folder.TORCH_BIN: lambda p: tbw.write(p, state, [s])}
    )

    def truncated(p):
      safetensors.numpy.save_file({"a.weight": np.ones((64, 64), np.float32)}, p)
      with open(p, "r+b") as f:
        f.truncate(100)

    bad_st = _folder(os.path.join(d, "st"), {hf_folder.SINGLE: truncated})
    for source, want in ((bad_bin, "names the global os.system"), (bad_st, "model.safetensors")):
      proc = subprocess.run(
        [
          sys.executable,
          "-m",
          "looped.main",
          "--config=configs/convert.py",
          f"--workdir={os.path.join(d, 'out')}",
          f"--config.convert.source={source}",
        ],
        cwd=_REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": _REPO, "JAX_PLATFORMS": "cpu"},
      )
      self.assertEqual(proc.returncode, 2, proc.stderr)
      lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
      self.assertLen(lines, 1, proc.stderr)
      self.assertIn(want, lines[0])
      self.assertNotIn("Traceback", proc.stderr)
    self.assertFalse(os.path.exists(marker))


if __name__ == "__main__":
  absltest.main()
