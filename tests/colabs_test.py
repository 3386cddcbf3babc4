"""colabs/: notebooks stored without outputs, executed top to bottom on CPU with small parameters,
and the quickstart's runtime detection and config choice on faked TPU / GPU / CPU device lists."""

import glob
import os
import types

import nbformat
from absl.testing import absltest, parameterized
from nbclient import NotebookClient

import looped_testing as testing
from configs import benice, colab
from looped.benice import pipeline

COLABS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "colabs")
NOTEBOOKS = sorted(glob.glob(os.path.join(COLABS, "*.ipynb")))
NAMES = [(os.path.basename(p)[: -len(".ipynb")], p) for p in NOTEBOOKS]


def _parameters_index(nb) -> int:
  tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
  if len(tagged) != 1:
    raise AssertionError(f"expected one cell tagged 'parameters', found {len(tagged)}")
  return tagged[0]


class StoredNotebookTest(parameterized.TestCase):
  def test_all_notebooks_found(self):
    self.assertEqual([n for n, _ in NAMES], ["kv_formats", "quickstart", "serving"])

  @parameterized.named_parameters(NAMES)
  def test_stored_without_outputs(self, path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    self.assertEqual(nb.cells[0].cell_type, "markdown")  # What it shows, how long it takes.
    self.assertIn("time", nb.cells[0].source.lower())
    params = nb.cells[_parameters_index(nb)].source
    for name in ("REPO", "INSTALL", "SMALL", "WORKDIR"):
      self.assertIn(f"{name} = ", params)
    for cell in nb.cells:
      if cell.cell_type == "code":
        self.assertEqual(cell.outputs, [], f"{path}: a code cell has stored outputs")
        self.assertIsNone(cell.execution_count, f"{path}: a code cell has an execution count")


class ExecuteNotebookTest(testing.TempDirTestCase, parameterized.TestCase):
  """Runs each notebook in a fresh kernel from this environment, in a directory of its own."""

  @parameterized.named_parameters(NAMES)
  def test_runs_on_cpu_and_shows_tables_and_plots(self, path):
    nb = nbformat.read(path, as_version=4)
    workdir = os.path.join(self.tmp, "work")
    small = nbformat.v4.new_code_cell(f"INSTALL = False\nSMALL = True\nWORKDIR = {workdir!r}")
    nb.cells.insert(_parameters_index(nb) + 1, small)
    client = NotebookClient(
      nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": self.tmp}}
    )
    client.execute()  # Raises CellExecutionError on the first failing cell.
    nbformat.write(nb, os.path.join(self.tmp, os.path.basename(path)))  # Executed copy.

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    self.assertEqual([o for o in outputs if o.output_type == "error"], [])
    data = [o.get("data", {}) for o in outputs]
    self.assertTrue(any("image/png" in d for d in data), "no plot (image/png output)")
    tables = [d["text/markdown"] for d in data if "text/markdown" in d]
    self.assertTrue(any("|---" in t for t in tables), "no Markdown table output")
    self.assertTrue(os.listdir(workdir))  # The run wrote where WORKDIR said.


def _devices(platform: str, kind: str, count: int):
  return [types.SimpleNamespace(platform=platform, device_kind=kind, id=i) for i in range(count)]


class RuntimeTest(absltest.TestCase):
  def test_tpu_v2_8(self):
    rt = colab.detect(_devices("tpu", "TPU v2", 8))
    self.assertEqual(rt, colab.Runtime("tpu", 8, "TPU v2"))
    config = colab.benice_config(rt)
    pipeline.validate(config)
    self.assertEqual((config.model.d_model, config.model.dtype), (512, "bfloat16"))
    self.assertEqual(config.data.batch_size % 8, 0)
    self.assertEqual(config.data.seq_len, config.model.max_seq_len)
    # SMALL overrides the runtime: the smoke pipeline everywhere.
    self.assertEqual(colab.benice_config(rt, small=True), benice.get_config("smoke"))

  def test_gpu_and_cpu(self):
    gpu = colab.detect(_devices("cuda", "NVIDIA A100-SXM4-40GB", 1))
    self.assertEqual(gpu.platform, "gpu")
    config = colab.benice_config(gpu)
    pipeline.validate(config)
    self.assertEqual(config.model.dtype, "bfloat16")
    self.assertEqual(config.model.d_model, benice.get_config("").model.d_model)
    cpu = colab.detect(_devices("cpu", "cpu", 1))
    self.assertEqual(colab.benice_config(cpu), benice.get_config("smoke"))
    self.assertEqual(colab.detect(), colab.Runtime("cpu", 1, "cpu"))  # This machine.
    self.assertEqual(colab.get_config(), benice.get_config("smoke"))

  def test_bad_device_lists(self):
    with self.assertRaisesRegex(ValueError, "no devices"):
      colab.detect([])
    with self.assertRaisesRegex(ValueError, "unknown device platform 'metal'"):
      colab.detect(_devices("metal", "Apple M2", 1))


if __name__ == "__main__":
  absltest.main()
