"""serve_sim program: config validation and the command line through looped.main."""

import json
import os
import subprocess
import sys
import tempfile

from absl import flags
from absl.testing import absltest
from ml_collections import config_flags

from configs import serve_sim
from looped import config_checks, programs
from looped.model.cache_layout import KVLayout
from looped.scheduler import scheduler as scheduler_lib
from looped.sim import hardware, simulate, traces
from looped.sim import shape as shape_lib

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tempdir(test):
  tmp = tempfile.TemporaryDirectory()
  test.addCleanup(tmp.cleanup)
  return tmp.name


class ValidateTest(absltest.TestCase):
  def test_default_and_smoke_configs_are_valid(self):
    simulate.validate(serve_sim.get_config())
    simulate.validate(serve_sim.get_config("smoke"))
    self.assertIs(programs.load(serve_sim.get_config()), simulate)
    with self.assertRaisesRegex(ValueError, "allowed: 'smoke'"):
      serve_sim.get_config("tiny")

  def test_bad_fields_name_the_field_and_allowed_values(self):
    cases = [
      ("sim.kv_format", ("bf16", "int4"), "config.sim.kv_format .* one of bf16, fp8, mxfp8"),
      ("sim.kv_budget_bytes", (1e9, -5.0), "config.sim.kv_budget_bytes .* positive number or None"),
      ("sim.kv_budget_bytes", ("1e9",), "config.sim.kv_budget_bytes"),
      ("sim.kv_budget_bytes", (100.0,), "config.sim.kv_budget_bytes = 100.0 .* at least one page"),
      ("sim.share_kv", (True, "no"), "config.sim.share_kv .* True, False"),
      ("sim.trace", "/nonexistent.jsonl", "config.sim.trace .* existing Mooncake JSONL"),
      ("sim.time_scale", 0.0, "config.sim.time_scale .* > 0"),
      ("sim.page_size", 0, "config.sim.page_size .* >= 1"),
      ("sim.hardware", "tpu_v9", "config.sim.hardware .* 'h200'"),
      ("sim.hardware_json", "/nonexistent.json", "config.sim.hardware_json"),
      ("sim.weight_format", "int8", "config.sim.weight_format .* 'bf16'"),
      ("model.mlp_type", "gelu", "config.model.mlp_type .* 'swiglu', 'relu2'"),
      ("model.num_kv_heads", 5, "config.model.num_heads .* multiple of num_kv_heads"),
      ("synthetic.rate_per_s", -1.0, "config.synthetic.rate_per_s"),
    ]
    for path, value, message in cases:
      with self.subTest(path=path, value=value):
        config = serve_sim.get_config()
        node = config
        *parents, leaf = path.split(".")
        for p in parents:
          node = node[p]
        with node.ignore_type():
          node[leaf] = value
        with self.assertRaisesRegex(config_checks.ConfigError, message):
          simulate.validate(config)

  def test_hardware_json_rejects_infinity_and_nan(self):
    for text in ('{"peak_flops": Infinity}', '{"mem_bandwidth": NaN}', '{"peak_flops": -1}'):
      with self.subTest(text=text):
        tmp = self.enterContext(tempfile.TemporaryDirectory())
        path = os.path.join(tmp, "hw.json")
        with open(path, "w") as f:
          f.write(text)
        config = serve_sim.get_config()
        config.sim.hardware_json = path
        with self.assertRaisesRegex(config_checks.ConfigError, "positive finite number"):
          simulate.validate(config)

  def test_block_formats_need_head_dim_multiple_of_block(self):
    config = serve_sim.get_config()
    config.model.head_dim = 24
    config.sim.kv_format = ("fp8", "mxfp8")
    with self.assertRaisesRegex(
      config_checks.ConfigError, "sim.kv_format .* multiple of its block size 32"
    ):
      simulate.validate(config)

  def test_single_values_and_comma_lists_are_sweeps(self):
    config = serve_sim.get_config()
    with config.sim.ignore_type():
      config.sim.kv_budget_bytes = None
      config.sim.share_kv = True
      config.sim.kv_format = "bf16, nvfp4"
    simulate.validate(config)
    self.assertEqual(simulate.budgets(config), (None,))
    self.assertEqual(simulate.share_kv_values(config), (True,))
    self.assertEqual(simulate.kv_formats(config), ("bf16", "nvfp4"))


class ConfigFlagsTest(absltest.TestCase):
  """The overrides a user types, parsed by ml_collections as looped.main parses them."""

  def _parse(self, *overrides):
    argv = ["prog", f"--config={_REPO}/configs/serve_sim.py", *overrides]
    flag_values = flags.FlagValues()
    config = config_flags.DEFINE_config_file("config", flag_values=flag_values, sys_argv=argv)
    flag_values(argv)
    simulate.validate(config.value)
    return config.value

  def test_sweep_overrides(self):
    cases = {
      "--config.sim.kv_budget_bytes=(2e10, 8e10)": (2e10, 8e10),
      "--config.sim.kv_budget_bytes=(None, 8e10)": (None, 8e10),
      "--config.sim.kv_budget_bytes=2e10": (2e10,),
      "--config.sim.kv_budget_bytes=None": (None,),
    }
    for override, expected in cases.items():
      with self.subTest(override):
        self.assertEqual(simulate.budgets(self._parse(override)), expected)
    config = self._parse(
      "--config.sim.share_kv=True", "--config.sim.kv_format=bf16,fp8", "--config.sim.time_scale=2"
    )
    self.assertEqual(simulate.share_kv_values(config), (True,))
    self.assertEqual(simulate.kv_formats(config), ("bf16", "fp8"))
    self.assertEqual(config.sim.time_scale, 2.0)
    config = self._parse(
      "--config.sim.kv_format=('fp8', 'nvfp4')", "--config.sim.trace=" + __file__
    )
    self.assertEqual(simulate.kv_formats(config), ("fp8", "nvfp4"))


class PrefillBlockTest(absltest.TestCase):
  def test_blocks_cut_chunks_and_shared_hits_end_at_a_block(self):
    """Two 90-token requests with the same prompt, one after the other (16-token pages, a
    512-token step budget). Blocks of 32 cut the first prompt into 32 + 32 + 26 (3 steps, then 3
    decode steps); the second request hits 5 pages (80 tokens) unshared but, shared, only up
    to the last block boundary (64): its rest fits one step either way. Without blocks every
    prompt is one step."""
    m = serve_sim.get_config("smoke").model
    shape = shape_lib.ModelShape.from_config(m)
    hw = hardware.load("h200", "")
    reqs = [traces.Request(i, 10.0 * i, 90, 4, (7,), 512) for i in range(2)]
    got = {}
    for block in (32, None):
      for share in (True, False):
        cfg = scheduler_lib.SchedulerConfig(16, 512, 8, 1024, prefill_block=block)
        r = simulate.simulate_one(
          reqs, shape, hw, budget=None, layout=KVLayout(share, "bf16"), config=cfg
        )
        got[block, share] = (r["num_steps"], r["cached_prompt_tokens"])
    self.assertEqual(
      got,
      {
        (32, True): (6 + 4, 64),
        (32, False): (6 + 4, 80),
        (None, True): (4 + 4, 80),
        (None, False): (4 + 4, 80),
      },
    )

  def test_block_above_the_step_budget_is_refused(self):
    config = serve_sim.get_config("smoke")
    config.sim.prefill_block = config.sim.max_num_batched_tokens + 1
    with self.assertRaisesRegex(config_checks.ConfigError, "sim.prefill_block"):
      simulate.validate(config)


class CommandLineTest(absltest.TestCase):
  def test_main_with_trace_and_sweep_overrides(self):
    tmp = _tempdir(self)
    trace = os.path.join(tmp, "trace.jsonl")
    spec = traces.SyntheticSpec(
      num_requests=80,
      rate_per_s=20.0,
      num_sessions=4,
      system_prompt_tokens=512,
      mean_turn_tokens=200.0,
      mean_output_tokens=20.0,
      max_prompt_tokens=3000,
    )
    traces.write_mooncake(traces.synthetic(spec), trace)
    workdir = os.path.join(tmp, "w")
    cmd = [
      sys.executable,
      "-m",
      "looped.main",
      "--config=configs/serve_sim.py:smoke",
      f"--workdir={workdir}",
      f"--config.sim.trace={trace}",
      "--config.sim.kv_budget_bytes=(6e6, None)",
      "--config.sim.share_kv=(True,)",
      "--config.sim.kv_format=('bf16','nvfp4')",
      "--config.sim.check_invariants=False",
    ]
    proc = subprocess.run(cmd, cwd=_REPO, capture_output=True, text=True, timeout=600)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    with open(os.path.join(workdir, "sim", "results.json")) as f:
      results = json.load(f)
    runs = results["runs"]
    self.assertEqual(
      [(r["kv_budget_bytes"], r["share_kv"], r["kv_format"]) for r in runs],
      [(6e6, True, "bf16"), (6e6, True, "nvfp4"), (None, True, "bf16"), (None, True, "nvfp4")],
    )
    for r in runs:
      self.assertEqual(r["num_finished"] + r["num_rejected"], 80)
      self.assertEqual(set(r["ttft_s"]), {"mean", "p50", "p90", "p99"})
      for key in ("hit_rate", "requests_per_s", "output_tokens_per_s", "tpot_s", "preemptions"):
        self.assertIn(key, r)
    self.assertEqual(results["trace"]["path"], trace)
    for name in ("results.md", "hit_rate.png", "throughput.png", "ttft_p90.png"):
      self.assertTrue(os.path.getsize(os.path.join(workdir, "sim", name)) > 0, name)
    self.assertIn("| shared+nvfp4 | 0.006 GB |", proc.stdout)

  def test_bad_override_fails_before_compute(self):
    workdir = os.path.join(_tempdir(self), "w")
    cmd = [
      sys.executable,
      "-m",
      "looped.main",
      "--config=configs/serve_sim.py:smoke",
      f"--workdir={workdir}",
      "--config.sim.kv_format=(bf16,int4)",
    ]
    proc = subprocess.run(cmd, cwd=_REPO, capture_output=True, text=True, timeout=600)
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("config.sim.kv_format", proc.stderr)
    self.assertFalse(os.path.exists(os.path.join(workdir, "sim")))


if __name__ == "__main__":
  absltest.main()
