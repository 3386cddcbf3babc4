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

A worker that dies fails its test (xdist reports the crash); nothing is run again. Workers lost
to aborts inside XLA's compilation or `executable.serialize()` ran out of memory mappings
(vm.max_map_count: XLA:CPU maps each executable's code pages), so each test module ends with
its compiled programs freed (`_compiled_programs_freed_after_each_module`) and the engine keeps
a bounded number of compiled steps (looped/engine/step_table.py); the server tests use the
run's compilation cache like every other test.

`--cpu-durations=N` prints the N tests that used the most CPU: CI's budget is CPU-bound (2
cores), and wall-clock durations swing with whatever else runs, while the CPU seconds a test
spends (its process plus the subprocesses it waits for) do not.
"""

from __future__ import annotations

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
def _compiled_programs_freed_after_each_module():
  """Every test module starts with no compiled program of the modules before it alive in the
  worker: XLA:CPU maps each executable's code pages, and a worker that kept every program of
  half the suite ran into vm.max_map_count (65,530) and LLVM aborted it (docs/server.md, 'Memory
  mappings'). The run's persistent cache keeps what was compiled, so a later module that needs
  a program loads it."""
  yield
  import jax

  from looped.engine import step_table

  for table in list(step_table._TABLES.values()):
    table.clear()
  step_table._TABLES.clear()
  jax.clear_caches()


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
