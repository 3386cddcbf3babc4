"""Test-session plumbing: one persistent XLA compilation cache per run, CPU time per test.

Most of the suite's CPU time is XLA compiling the same small programs again: every test builds
its own jitted functions, and the multi-process tests compile the same steps in each process.
A compilation cache shared by the run's processes (xdist workers and the subprocesses they
start, through the environment) compiles each program once: 40% less CPU for
tests/model_test.py. It starts empty and is removed at the end, so no run reads another's
executables; a user's own JAX_COMPILATION_CACHE_DIR is left alone.

XLA's CPU backend compiles the tests' programs with LLVM at optimization level 0 and without
its expensive passes (added to XLA_FLAGS unless it names an optimization level already): the
programs are tiny, so compiling is most of their cost, and level 0 alone took 35% less CPU for
tests/model_block_prefill_test.py (130 -> 84 s, jax 0.10.2). XLA's own passes (fusion, layout)
are the same, so the tests check the same programs; floats can differ in their last bits
(LLVM's instruction choices), and the generated code is slower. It also turns off XLA:CPU's MLIR
fusion emitters (the LLVM IR ones generate the same fusions), splits no module for parallel
codegen and leaves dots to XLA rather than XNNPACK: compiling is ~55% of a test's CPU time
(cProfile of tests/document_mask_test.py), and these flags took that file from 49.6 to 27.9
CPU-s and tests/kda_test.py + tests/mixers_test.py (`-n 2`) from 139 to 91 user-s (2026-12-05,
jax 0.10.2; the fusion emitters alone: 49.6 -> 29.5).

The server tests (tests/server_*_test.py) run without that cache: they run the engine in a
thread of the test process beside the test's own JAX work, and writing an executable to the
cache there crashed the process twice (a segfault in `executable.serialize()`, jax 0.10.2).

A test whose xdist worker dies under it runs once more on a fresh worker, shown as R and listed
at the end of the run; a second crash, or any failure that is not a crash, fails as usual. Five
full runs of 2026-12-04/05 lost six workers to a segfault inside XLA, always in compilation or
`executable.serialize()`, mostly in two tests that pass alone (the crash depends on what the
worker ran before); the two full runs since the fusion-emitter flags above lost none.

`--cpu-durations=N` prints the N tests that used the most CPU: CI's budget is CPU-bound (2
cores), and wall-clock durations swing with whatever else runs, while the CPU seconds a test
spends (its process plus the subprocesses it waits for) do not.
"""

from __future__ import annotations

import collections
import os
import resource
import shutil
import sys
import tempfile

import pytest

_CACHE_ENV = {
  "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # Tiny test programs too.
  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
  # No size limit: with one, jax locks the directory and, on every write, reads the size and
  # access time of every entry (quadratic in the run's thousands of entries: about a fifth of
  # the suite's CPU). An entry read while another process still writes it is truncated, fails
  # to decompress, and jax compiles the program again (a warning, never a wrong executable).
}

_OPT_FLAG = (
  "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  # XLA:CPU's older LLVM IR emitters compile these small fusions in far less time than its MLIR
  # fusion emitters; one codegen module and no XNNPACK rewrites (measured below).
  " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
  " --xla_cpu_use_xnnpack=false"
)

_CPU_S = {}  # nodeid -> CPU seconds of its setup, call and teardown (read where reports land).
_START = {}  # nodeid -> CPU seconds when its setup began (in the process that runs it).


def _cpu_seconds() -> float:
  total = 0.0
  for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
    usage = resource.getrusage(who)
    total += usage.ru_utime + usage.ru_stime
  return total


def pytest_configure(config):
  """Gives the run a fresh cache and the unoptimized CPU code; xdist workers and subprocesses
  inherit both through the environment (workers start after the controller's pytest_configure)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_backend_optimization_level" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_OPT_FLAG}".strip()
  if hasattr(config, "workerinput") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  path = tempfile.mkdtemp(prefix="looped-test-xla-cache-")
  config._looped_xla_cache = path
  os.environ.update(_CACHE_ENV, JAX_COMPILATION_CACHE_DIR=path)
  if "jax" in sys.modules:  # Imported before this hook: its config has read the environment.
    jax = sys.modules["jax"]
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@pytest.fixture(scope="module", autouse=True)
def _no_compilation_cache_beside_an_engine_thread(request):
  """Module-scoped, so it is in place before a TestCase's setUpClass starts a server."""
  if not os.path.basename(str(request.path)).startswith("server_"):
    yield
    return
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()  # The cache's use is decided once per process otherwise.
  yield
  jax.config.update("jax_enable_compilation_cache", enabled)
  compilation_cache.reset_cache()


_CRASHED = collections.Counter()  # nodeid -> crashes (in the xdist controller).


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
  """xdist: a test that crashed its worker the first time is scheduled once more."""
  _CRASHED[crashitem] += 1
  if _CRASHED[crashitem] == 1:
    sched.mark_test_pending(crashitem)
    report.outcome = "rerun"


def pytest_report_teststatus(report, config):
  if report.outcome == "rerun":
    return "rerun", "R", "RERUN"
  return None


def pytest_unconfigure(config):
  path = getattr(config, "_looped_xla_cache", None)
  if path:
    shutil.rmtree(path, ignore_errors=True)


def pytest_addoption(parser):
  parser.addoption(
    "--cpu-durations",
    type=int,
    default=0,
    metavar="N",
    help="Print the N tests that used the most CPU time (process + waited-for children).",
  )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  if call.when == "teardown":  # Carried to the controller process under xdist.
    report = outcome.get_result()
    report.user_properties.append(("cpu_s", _cpu_seconds() - _START.get(item.nodeid, 0.0)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  _START[item.nodeid] = _cpu_seconds()


def pytest_runtest_logreport(report):
  if report.when == "teardown":
    for key, value in report.user_properties:
      if key == "cpu_s":
        _CPU_S[report.nodeid] = value


def pytest_terminal_summary(terminalreporter, config):
  if _CRASHED:
    terminalreporter.section("tests whose worker crashed (run once more)")
    for nodeid, crashes in _CRASHED.items():
      terminalreporter.write_line(f"{nodeid}: {crashes} crash(es)")
  n = config.getoption("--cpu-durations")
  if not n or not _CPU_S:
    return
  rows = sorted(_CPU_S.items(), key=lambda kv: -kv[1])
  terminalreporter.section(f"{n} largest CPU times (process + children)")
  for nodeid, seconds in rows[:n]:
    terminalreporter.write_line(f"{seconds:8.1f}s cpu  {nodeid}")
  terminalreporter.write_line(f"{sum(_CPU_S.values()):8.1f}s cpu  in all {len(rows)} tests")


# The longest tests (wall seconds of a 2-worker run; `--durations`), started first: xdist hands
# tests out in collection order, so a long test collected last keeps one worker busy while the
# other idles. Order matters only for the run's length, never for a result.
_LONG_FIRST = (
  "tests/sharding_test.py::MeshTrainingTest",
  "tests/docs_test.py::DocsTest::test_quick_commands_run_from_a_fresh_copy",
  "tests/model_attention_impl_test.py::AttentionImplTest::test_block_prefill_jacobi_matches_xla",
  "tests/multihost_test.py",
  "tests/benice_pipeline_test.py::PipelineTest",
  "tests/engine_mesh_test.py",
  "tests/convert_e2e_test.py",
  "tests/engine_test.py::EngineConcurrencyTest",
  "tests/mixers_test.py::MixerKvFormatTest",
  "tests/scale_test.py",
)


def pytest_collection_modifyitems(config, items):
  def rank(item):
    ids = [i for i, prefix in enumerate(_LONG_FIRST) if item.nodeid.startswith(prefix)]
    return ids[0] if ids else len(_LONG_FIRST)

  items.sort(key=rank)  # Stable: the rest keep their order.
