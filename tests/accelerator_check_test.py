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

  def test_levers_profile_and_targets(self):
    checks = self.result["checks"]
    levers = checks["train_350m_levers"]
    self.assertEqual(
      levers["levers"], accelerator_check.TOY["train"]["train_350m_levers"]["levers"]
    )
    self.assertEqual(levers["param_dtype"], "bfloat16")
    self.assertEqual(checks["train_140m_xla"]["attention_impl"], "xla")
    self.assertEqual(checks["train_140m"]["attention_impl"], "auto")
    # Causal attention counted once: fewer FLOPs than the full scores, the same step time.
    for name in ("train_140m", "train_350m_levers"):
      row = checks[name]
      self.assertLess(row["step_flops_causal"], row["step_flops"])
      ratio = row["mfu_measured_causal"] / row["mfu_measured"]
      self.assertAlmostEqual(ratio, row["step_flops_causal"] / row["step_flops"])
    # The trainer's profiler: the top ops of the traced steps, by time.
    ops = levers["top_ops"]
    self.assertNotEmpty(ops)
    self.assertEqual([op["ms"] for op in ops], sorted((op["ms"] for op in ops), reverse=True))
    self.assertLessEqual(sum(op["share"] for op in ops), 1.0 + 1e-9)
    # Decode targets against this run's copy rate; nvfp4 against bf16's time on the same pages.
    bf16, nvfp4 = checks["paged_decode_bf16"], checks["paged_decode_nvfp4"]
    self.assertEqual(bf16["target_met"], bf16["of_copy"] >= bf16["target_of_copy"])
    self.assertAlmostEqual(nvfp4["speed_vs_bf16"], bf16["kernel_s"] / nvfp4["kernel_s"])
    self.assertEqual(nvfp4["target_met"], nvfp4["speed_vs_bf16"] >= 1.0)

  def test_engine_paths_and_the_model_decode(self):
    checks = self.result["checks"]
    for layout in ("unshared", "shared"):
      self.assertEqual(checks[f"engine_{layout}_gather"]["attention_impl"], "xla")
      model = checks[f"decode_model_{layout}"]
      self.assertEqual(model["layout"], layout)
      self.assertGreater(model["decode_tokens_per_s"], 0)
      self.assertEqual(model["params"], checks[f"engine_{layout}"]["params"])  # The same model.

  def test_pilot_reports_every_model(self):
    pilot = self.result["checks"]["pilot"]
    self.assertEqual(set(pilot["models"]), {"zero_shot", "finetune", "benice"})
    for name, m in pilot["models"].items():
      self.assertTrue(np.isfinite(m["gap_exact"]), name)
      self.assertGreater(m["ppl_unshared_eval"], 1.0, name)
    bn, ft = pilot["models"]["benice"], pilot["models"]["finetune"]
    self.assertAlmostEqual(
      pilot["ppl_vs_finetune"], bn["ppl_unshared_eval"] / ft["ppl_unshared_eval"] - 1
    )
    self.assertEqual(pilot["pretrain_last"]["step"], 20)  # configs/benice.py:smoke's.

  def test_deadline_skips_what_does_not_fit(self):
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "check.json")
      result = accelerator_check.run(True, out, only=("limits", "pilot"), deadline_s=0.0)
    self.assertEqual({r["status"] for r in result["checks"].values()}, {"skipped"})
    expected = accelerator_check.EXPECTED_S["pilot"]
    self.assertIn(f"expected {expected:.0f} s, 0 s left", result["checks"]["pilot"]["reason"])
    self.assertIn("| pilot | skipped | not started", accelerator_check.table(result))

  def test_table_goes_between_the_docs_markers(self):
    text = accelerator_check.table(self.result)
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "doc.md")
      begin, end = accelerator_check.DOCS_BEGIN, accelerator_check.DOCS_END
      with open(path, "w") as f:
        f.write(f"before\n{begin}\nold table\n{end}\nafter\n")
      accelerator_check.write_docs(path, text)
      with open(path) as f:
        doc = f.read()
      self.assertEqual(doc, f"before\n{begin}\n{text}\n{end}\nafter\n")
      with open(path, "w") as f:
        f.write("no markers\n")
      with self.assertRaisesRegex(ValueError, "needs one"):
        accelerator_check.write_docs(path, text)
    with open(os.path.join(_REPO, "docs", "kernels.md")) as f:
      doc = f.read()
    self.assertEqual((doc.count(begin), doc.count(end)), (1, 1))

  def test_table_lists_every_check(self):
    text = accelerator_check.table(self.result)
    for name in self.result["checks"]:
      self.assertIn(f"| {name} |", text)


if __name__ == "__main__":
  absltest.main()
