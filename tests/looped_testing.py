"""Shared test utilities: a tiny model, config overrides, temporary workdirs.

Lives beside the tests (it imports `configs`, which the library does not): every test file
imports it as `import looped_testing as testing` (pytest puts tests/ on the path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest

from looped.model.config import ModelConfig

# Larger weights than the default init, so recurrences differ visibly and sharing changes the
# outputs; P/B/C = 1/2/1, R = 3, GQA 4 query / 2 KV heads of 8.
TINY_MODEL = ModelConfig(
  vocab_size=61,
  d_model=32,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  mlp_dim=48,
  num_prelude_layers=1,
  num_core_layers=2,
  num_coda_layers=1,
  num_recurrences=3,
  max_seq_len=16,
  init_std=0.2,
)


# Every layer KDA: a model with only per-sequence state, which the engine has nothing to page.
KDA_ONLY_OVERRIDES = {f"model.{s}_mixers": ("kda",) for s in ("prelude", "core", "coda")}


# A short smoke pretraining for trainer and fault tests: 32-token rows, batches of 4.
TINY_RUN_OVERRIDES = {
  "data.seq_len": 32,
  "data.batch_size": 4,
  "data.eval_batch_size": 4,
  "data.num_eval_batches": 1,
  "data.max_documents": 40,
  "model.max_seq_len": 32,
}


# What XLA:CPU prints when it ends a process whose devices waited too long in a collective.
XLA_CPU_COLLECTIVE_TIMEOUT = "Termination timeout for"


def fake_cpu_devices_env(count: int) -> dict:
  """The environment of a subprocess whose CPU backend is `count` fake devices.

  XLA:CPU runs each fake device on threads of its own and may start two independent collectives
  in a different order on different devices; on two loaded cores it then deadlocked (5 of 8
  devices in a collective permute, 3 in an all-reduce, jax 0.10.2) and ended the process after
  its collective timeout (40 s by default). The timeout is raised to 120 s so that slowness
  under load is not taken for that; the tests run a worker that ended so once more.
  """
  flags = [
    *os.environ.get("XLA_FLAGS", "").split(),  # The test run's own (tests/conftest.py).
    f"--xla_force_host_platform_device_count={count}",
    "--xla_cpu_collective_call_terminate_timeout_seconds=120",
  ]
  return dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")


def smoke_config(overrides: dict):
  """configs/pretrain.py:smoke with TINY_RUN_OVERRIDES and then `overrides` applied."""
  from configs import pretrain  # Lazy: looped does not import configs at import time.

  config = pretrain.get_config("smoke")
  for key, value in {**TINY_RUN_OVERRIDES, **overrides}.items():
    set_field(config, key, value)
  return config


def saved_params(model_cfg, workdir: str, step: int | None = None):
  """The verified params of a run's checkpoint (the latest, or `step`), to compare runs."""
  import jax  # Lazy, like configs above: importing looped_testing stays cheap.
  import numpy as np

  from looped.checkpoints import checkpointing
  from looped.model import LoopedLM, from_config, init_params

  model = LoopedLM(from_config(model_cfg))
  tokens = np.zeros((1, 8), np.int32)
  abstract = jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0), tokens))
  return checkpointing.restore_params(workdir, abstract, step)


_RANDOM_PARAMS = {}


def random_params(model_cfg: ModelConfig, seed: int = 0, tokens_shape=(1, 8)):
  """init_params(LoopedLM(model_cfg), PRNGKey(seed), zeros(tokens_shape)), as one compiled
  program (flax's init run op by op compiles every op of the model on its own: twice the CPU)
  and once per process: tests that only need some fixed random params share them. The arrays
  are never donated by the engine or trainer paths that read them; do not mutate them."""
  key = (model_cfg, seed, tuple(tokens_shape))
  if key not in _RANDOM_PARAMS:
    import jax
    import jax.numpy as jnp

    from looped.model import LoopedLM, init_params

    model = LoopedLM(model_cfg)
    init = jax.jit(lambda rng: init_params(model, rng, jnp.zeros(tokens_shape, jnp.int32)))
    _RANDOM_PARAMS[key] = init(jax.random.PRNGKey(seed))
  return _RANDOM_PARAMS[key]


def set_field(config, dotted: str, value) -> None:
  """config.<dotted> = value, even if the type differs (to test bad values)."""
  node = config
  *parents, leaf = dotted.split(".")
  for p in parents:
    node = node[p]
  with node.ignore_type():
    node[leaf] = value


def write_byte_level_tokenizer(path: str) -> None:
  """A Hugging Face tokenizer.json without merges: the 256 byte-level symbols (ids 0..255, so
  any text round-trips) and '<|end_of_text|>' (id 256)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
  vocab["<|end_of_text|>"] = len(vocab)
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.add_special_tokens(["<|end_of_text|>"])
  tokenizer.save(path)


class TempDirTestCase(absltest.TestCase):
  """self.tmp: a fresh directory per test (absltest's create_tempdir needs parsed flags,
  which pytest does not provide)."""

  def setUp(self):
    super().setUp()
    self._tmp = tempfile.TemporaryDirectory()
    self.tmp = self._tmp.name

  def tearDown(self):
    self._tmp.cleanup()
    super().tearDown()

  def write_report(self, run: str, models: dict) -> str:
    """A pipeline workdir self.tmp/run holding only report/shareability.json with `models`."""
    os.makedirs(os.path.join(self.tmp, run, "report"))
    with open(os.path.join(self.tmp, run, "report", "shareability.json"), "w") as f:
      json.dump({"models": models}, f)
    return os.path.join(self.tmp, run)


def tracked_files(repo: str) -> list[str]:
  """Files of the repository that exist, relative to it: git's list, or a walk outside git."""
  try:
    out = subprocess.run(
      ["git", "ls-files"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.splitlines()
  except (OSError, subprocess.CalledProcessError):  # Not a git checkout: walk the tree.
    out = [
      os.path.relpath(os.path.join(d, f), repo)
      for d, dirs, files in os.walk(repo)
      if ".git" not in d.split(os.sep)
      for f in files
    ]
  return [p for p in out if os.path.isfile(os.path.join(repo, p))]


def start_server(workdir: str, flags: list[str], timeout_s: float = 240) -> tuple:
  """`python -m looped.main --config=configs/serve.py...` as a process in the repository root,
  started with `flags` into `workdir`; (process, the server.json it wrote) once it serves.
  AssertionError if it exits first or writes none in `timeout_s`. The caller ends the process."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.Popen(
    [sys.executable, "-m", "looped.main", f"--workdir={workdir}", *flags],
    cwd=repo,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  info_path = os.path.join(workdir, "server.json")
  deadline = time.monotonic() + timeout_s
  while not os.path.exists(info_path):
    if proc.poll() is not None:
      raise AssertionError(f"the server exited before it started:\n{proc.communicate()[0]}")
    if time.monotonic() > deadline:
      proc.kill()
      raise AssertionError(f"no server.json in {timeout_s} s:\n{proc.communicate()[0]}")
    time.sleep(0.1)
  with open(info_path) as f:
    return proc, json.load(f)
