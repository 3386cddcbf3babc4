"""benchmarks/accelerator_check.py on CPU (--toy: tiny shapes, Pallas interpret mode).

The script is the one run that checks the kernels, the training step and the engine on an
accelerator. Here its CPU path runs as a command, with XLA's CPU backend optimisation off (the
toy programs are compile-bound; that halves their CPU time), and its JSON is read back: every
check reports 'ok', every kernel's error against the
float32 reference is within its dtype's tolerance, and the rows hold the figures that the table
and docs/kernels.md read.
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from absl.testing import absltest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_REPO, "benchmarks"))

import accelerator_check  # noqa: E402


class AcceleratorCheckTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    tmp = tempfile.TemporaryDirectory()
    cls.addClassCleanup(tmp.cleanup)
    cls.out = os.path.join(tmp.name, "check.json")
    script = os.path.join(_REPO, "benchmarks", "accelerator_check.py")
    subprocess.run(
      [sys.executable, script, "--toy", f"--out={cls.out}"],
      check=True,
      timeout=900,
      stdout=subprocess.DEVNULL,
    )
    with open(cls.out) as f:
      cls.result = json.load(f)

  def test_every_check_ran_ok(self):
    checks = self.result["checks"]
    expected = {name for name, _, _ in accelerator_check._checks(accelerator_check.TOY)}
    self.assertEqual(set(checks), expected)
    for fmt in ("raw", "bf16", "fp8", "mxfp8", "mxfp8_rceil", "nvfp4"):
      self.assertIn(f"paged_decode_{fmt}", checks)
    for name in ("shared_attention_bf16_fwd", "shared_attention_bf16_bwd", "train_350m"):
      self.assertIn(name, checks)
    bad = {name: row.get("error") for name, row in checks.items() if row["status"] != "ok"}
    self.assertEqual(bad, {})
    self.assertTrue(self.result["setup"]["toy"])

  def test_kernels_match_the_reference_within_tolerance(self):
    kernels = {n: r for n, r in self.result["checks"].items() if r["kind"] == "kernel"}
    self.assertLen(kernels, 13)
    for name, row in kernels.items():
      tol = accelerator_check.TOLERANCE[row["dtype"]]
      self.assertEqual(row["tolerance"], tol, name)
      self.assertTrue(row["pass"], name)
      self.assertLessEqual(row["rel_err"], tol, name)
      self.assertTrue(np.isfinite(row["max_abs_err"]), name)
      self.assertGreater(row["ref_max"], 0.1, name)  # Not a comparison of zeros.
      self.assertNotIn("nan_in_output", row, name)  # NaN in unused page slots stays out.
    # float32 kernels agree to a few ulps (interpret mode, exact float32 products).
    self.assertLess(kernels["shared_attention_f32"]["rel_err"], 1e-5)
    self.assertLess(kernels["shared_attention_f32"]["grad_rel_err"], 1e-5)
    self.assertLess(kernels["paged_decode_raw"]["rel_err"], 1e-5)
    self.assertLess(kernels["block_prefill"]["grad_rel_err"], 1e-5)
    self.assertEqual(kernels["paged_decode_raw"]["dtype"], "float32")
    self.assertEqual(kernels["paged_decode_nvfp4"]["dtype"], "bfloat16")
    grads = kernels["shared_attention_bf16_bwd"]["grad_rel_err_each"]
    self.assertEqual(set(grads), {"q", "k", "v", "k_past", "v_past"})

  def test_speed_rows_are_against_the_measured_limits(self):
    checks = self.result["checks"]
    limits = checks["limits"]
    self.assertGreater(limits["matmul_tflops"], 0)
    self.assertGreater(limits["copy_gbps"], 0)
    fwd = checks["shared_attention_bf16_fwd"]
    self.assertAlmostEqual(fwd["of_matmul"], fwd["kernel_tflops"] / limits["matmul_tflops"])
    self.assertAlmostEqual(fwd["xla_over_kernel"], fwd["xla_s"] / fwd["kernel_s"])
    decode = checks["paged_decode_fp8"]
    self.assertAlmostEqual(decode["of_copy"], decode["kernel_gbps"] / limits["copy_gbps"])
    self.assertLess(decode["bytes"], checks["paged_decode_bf16"]["bytes"])  # 1 byte vs 2.

  def test_train_and_engine_rows(self):
    checks = self.result["checks"]
    for name in ("train_140m", "train_350m"):
      row = checks[name]
      self.assertGreater(row["params"], 1000)
      self.assertGreater(row["step_s"], 0)
      self.assertAlmostEqual(
        row["mfu_measured"],
        row["step_flops"] / row["step_s"] / 1e12 / checks["limits"]["matmul_tflops"],
      )
      self.assertTrue(np.isfinite(row["final_loss"]))
    for layout in ("unshared", "shared"):
      row = checks[f"engine_{layout}"]
      self.assertEqual(row["layout"], layout)
      self.assertGreater(row["decode_tokens_per_s"], 0)
      for run in row["runs"]:
        self.assertEqual(run["generated"], row["requests"] * row["new_tokens"])

  def test_table_lists_every_check(self):
    text = accelerator_check.table(self.result)
    for name in self.result["checks"]:
      self.assertIn(f"| {name} |", text)


if __name__ == "__main__":
  absltest.main()
