"""configs/serve.py as a command: bad fields fail before anything is bound, naming the field; the
server process writes server.json, and on SIGTERM finishes the stream in flight and exits 0 with
every page free. Also the batch program's one-line error for a prompts file that is not UTF-8.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from absl.testing import absltest

import looped_testing as testing
from configs import serve as serve_config
from looped import config_checks, programs
from looped.checkpoints import model_record
from looped.server import client
from looped.train import trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TIMEOUT_S = 240
_TRAIN = {
  "train.num_steps": 1,
  "train.checkpoint_every": 1,
  "train.log_every": 1,
  "train.eval_every": 1,
  "train.warmup_steps": 1,
}


def _config(checkpoint, **overrides):
  config = serve_config.get_config("smoke")
  config.model.max_seq_len = testing.TINY_RUN_OVERRIDES["model.max_seq_len"]
  config.serve.checkpoint = checkpoint
  for key, value in overrides.items():
    testing.set_field(config, key, value)
  return config


class ServerProgramTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._tmp = tempfile.TemporaryDirectory()
    cls.train_dir = os.path.join(cls._tmp.name, "train")
    trainer.run(testing.smoke_config(_TRAIN), cls.train_dir)

  @classmethod
  def tearDownClass(cls):
    cls._tmp.cleanup()
    super().tearDownClass()

  def _fails(self, config, pattern):
    workdir = os.path.join(self._tmp.name, "never")
    with self.assertRaisesRegex(config_checks.ConfigError, pattern):
      programs.validate(config, workdir)
    self.assertFalse(os.path.exists(workdir))

  def test_bad_configs_fail_naming_the_field(self):
    programs.validate(_config(self.train_dir), os.path.join(self._tmp.name, "ok"))
    self._fails(_config(""), "serve.checkpoint")
    self._fails(_config(os.path.join(self._tmp.name, "nope")), "serve.checkpoint.*existing")
    for field, value, pattern in (
      ("serve.port", 70000, "serve.port.*<= 65535"),
      ("serve.port", "80", "serve.port.*integer"),
      ("serve.host", "", "serve.host"),
      ("serve.kv_budget_bytes", 1000.0, "serve.kv_budget_bytes.*needs 2"),
      ("serve.kv_budget_bytes", None, "serve.kv_budget_bytes.*finite number"),
      ("serve.kv_format", "fp4", "serve.kv_format"),
      ("serve.share_kv", "yes", "serve.share_kv"),
      ("serve.max_waiting", -1, "serve.max_waiting"),
      ("serve.max_num_seqs", 0, "serve.max_num_seqs"),
      ("serve.max_logprobs", 50, "serve.max_logprobs"),
      ("serve.row_buckets", (4,), "serve.row_buckets.*must reach 8"),
      ("serve.token_buckets", (0, 64), "serve.token_buckets.*positive integers"),
      ("serve.drain_timeout_s", float("nan"), "serve.drain_timeout_s"),
      ("mesh.tensor", 3, r"config.mesh.tensor = 3 does not divide the model's num_heads = 2"),
      ("mesh.tensor", 2, r"config.mesh = .* needs 2 devices; there are 1"),
      ("mesh.data", 0, "mesh.data"),
    ):
      with self.subTest(field=field, value=value):
        self._fails(_config(self.train_dir, **{field: value}), pattern)
    # A model of KDA layers only has nothing to page: refused for a workdir without a recorded
    # model (with one, the recorded model is used; tests/model_record_test.py covers overrides).
    unrecorded = os.path.join(self._tmp.name, "unrecorded")
    shutil.copytree(self.train_dir, unrecorded, dirs_exist_ok=True)
    os.remove(os.path.join(unrecorded, model_record.FILENAME))
    self._fails(_config(unrecorded, **testing.KDA_ONLY_OVERRIDES), "config.model.*kda")

  def test_sigterm_drains_the_stream_in_flight_and_exits(self):
    workdir = os.path.join(self._tmp.name, "serve")
    proc, info = testing.start_server(
      workdir,
      [
        "--config=configs/serve.py:smoke",
        f"--config.serve.checkpoint={self.train_dir}",
        "--config.model.max_seq_len=32",
        "--config.serve.max_num_seqs=1",
        # Few call shapes to warm up (one row; 1 or 16 tokens; 1-3 page-table columns).
        "--config.serve.max_num_batched_tokens=16",
        "--config.serve.prefill_block=16",
        "--config.serve.token_buckets=(16,)",
      ],
      timeout_s=_TIMEOUT_S,
    )
    try:
      self.assertEqual((info["host"], info["pid"], info["model"]), ("127.0.0.1", proc.pid, "train"))
      url = info["url"]
      self.assertEqual(client.request(url + "/health"), (200, {"status": "ok"}))
      # One request runs at a time (serve.max_num_seqs=1): when SIGTERM comes during the first
      # stream, the other two are still queued in the engine; all three must finish.
      streams = [
        client.Stream(
          url + "/v1/completions",
          {"prompt": p, "max_tokens": 20, "temperature": 0, "ignore_eos": True},
          timeout_s=_TIMEOUT_S,
        )
        for p in ("abc", "def", "ghi")
      ]
      events = iter(streams[0])
      first = next(events)
      proc.send_signal(signal.SIGTERM)
      outputs = [[first, *events]] + [list(s) for s in streams[1:]]
      for stream, chunks in zip(streams, outputs):
        stream.close()
        self.assertTrue(stream.done)
        self.assertLen(chunks, 21)  # A chunk per token, then the finish: it ran to its end.
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "length")
      output, _ = proc.communicate(timeout=_TIMEOUT_S)
      self.assertEqual(proc.returncode, 0, output)
      with self.assertRaises(OSError):  # Nothing listens any more.
        client.request(url + "/health", timeout_s=5)
      with open(os.path.join(workdir, "server_stats.json")) as f:
        stats = json.load(f)
      self.assertEqual((stats["pages_in_use_at_end"], stats["finished"]), (0, 3))
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.communicate()

  def test_generate_prompts_file_not_utf8_is_a_one_line_error(self):
    prompts = os.path.join(self._tmp.name, "prompts.txt")
    with open(prompts, "wb") as f:
      f.write(b"ok\n\xe9t\xe9\n")  # Latin-1, not UTF-8.
    proc = subprocess.run(
      [
        sys.executable,
        "-m",
        "looped.main",
        "--config=configs/generate.py:smoke",
        f"--workdir={os.path.join(self._tmp.name, 'gen')}",
        f"--config.gen.checkpoint={self.train_dir}",
        f"--config.gen.prompts={prompts}",
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=_TIMEOUT_S,
    )
    self.assertEqual(proc.returncode, 2, proc.stderr)
    self.assertEqual(
      proc.stderr.strip(),
      f"error: config.gen.prompts = {prompts!r} is invalid: line 2 is not UTF-8 "
      "(byte 1: invalid continuation byte).",
    )


if __name__ == "__main__":
  absltest.main()
