"""The launchers: sweep dry runs, TPU VM and SLURM commands, and real multi-process runs on CPU.

local.py runs `looped.main` in 2 processes joined by jax.distributed (gloo on CPU); the
shell launchers are checked in dry run (no gcloud or slurm here) and by running the command
they would hand to each worker with `echo` as the Python. The XManager objects are built only
where the optional `.[launch]` extra is installed; nothing else needs it.
"""

import hashlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys

from absl.testing import absltest

import looped_testing as testing
from looped import startup
from looped.checkpoints import workdir_lock
from looped.config_checks import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, "launch")
# A 4-step smoke pretraining, checkpointed and evaluated at its end; one fixed-depth core
# layer run twice, as the 2 processes compile it on 2 shared cores.
TINY_RUN = [
  "--config=configs/pretrain.py:smoke",
  *(f"--config.{k}={v}" for k, v in testing.TINY_RUN_OVERRIDES.items()),
  "--config.model.num_prelude_layers=0",
  "--config.model.num_coda_layers=0",
  "--config.model.num_core_layers=1",
  "--config.model.num_recurrences=2",
  "--config.depth.sampler=fixed",
  "--config.train.num_steps=4",
  "--config.train.log_every=2",
  "--config.train.eval_every=4",
  "--config.train.checkpoint_every=4",
]


def _load_xm_launch():
  """launch/xm_launch.py as a module (launch/ is scripts, not a package)."""
  spec = importlib.util.spec_from_file_location("xm_launch", os.path.join(LAUNCH, "xm_launch.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules["xm_launch"] = module  # dataclasses look their module up.
  spec.loader.exec_module(module)
  return module


def _has_xmanager() -> bool:
  return importlib.util.find_spec("xmanager") is not None


# Cheaper CPU compiles (a third less CPU time); local.py keeps them next to its device count.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
LOCAL_ENV = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}")


def _local(*args):
  return subprocess.run(
    [sys.executable, os.path.join(LAUNCH, "local.py"), *args],
    cwd=REPO,
    env=LOCAL_ENV,
    capture_output=True,
    text=True,
    timeout=300,
  )


class XmLaunchDryRunTest(testing.TempDirTestCase):
  def test_dry_run_lists_one_job_per_sweep_point_without_xmanager(self):
    # An `xmanager` that fails on import: the dry run must not import it, installed or not.
    fake = os.path.join(self.tmp, "fake")
    os.makedirs(os.path.join(fake, "xmanager"))
    with open(os.path.join(fake, "xmanager", "__init__.py"), "w") as f:
      f.write("raise ImportError('the dry run imported xmanager')\n")
    proc = subprocess.run(
      [
        sys.executable,
        os.path.join(LAUNCH, "xm_launch.py"),
        "--config=configs/benice.py:fixed",
        "--workdir_root=/runs/sweep",
        "--sweep=config.seed=0,1",
        "--sweep=config.model.injection=linear,diagonal",
        "--extra_flag=--config.train.num_steps=7",
        "--dry_run",
      ],
      capture_output=True,
      text=True,
      env=dict(os.environ, PYTHONPATH=fake),
      timeout=60,
    )
    self.assertEqual(proc.returncode, 0, proc.stderr)
    expected = ["4 work units (executor: local)"]
    for i, (seed, injection) in enumerate(
      [(0, "linear"), (0, "diagonal"), (1, "linear"), (1, "diagonal")], 1
    ):
      name = f"seed_{seed}-injection_{injection}"
      expected += [
        f"[{i}/4] {name}",
        f"  overrides: seed={seed} model.injection={injection}",
        f"  workdir: /runs/sweep/{name}",
        "  command: python -m looped.main --config=configs/benice.py:fixed "
        f"--workdir=/runs/sweep/{name} --config.seed={seed} "
        f"--config.model.injection={injection} --config.train.num_steps=7",
      ]
    expected.append("xm_launch: --dry_run, nothing launched.")
    self.assertEqual(proc.stdout.splitlines(), expected)

  def test_sweep_values_keep_commas_inside_brackets_and_names_stay_unique(self):
    xm_launch = _load_xm_launch()
    jobs = xm_launch.build_jobs(
      "c.py",
      "/r",
      ["model.core_mixers=('gqa',),('kda','mla')", "config.data.seed=3", "config.seed=1"],
      [],
    )
    self.assertEqual(
      [j.overrides for j in jobs],
      [
        (("model.core_mixers", "('gqa',)"), ("data.seed", "3"), ("seed", "1")),
        (("model.core_mixers", "('kda','mla')"), ("data.seed", "3"), ("seed", "1")),
      ],
    )
    # 'seed' would also name data.seed: that one is named by its longer suffix.
    self.assertEqual(
      [j.name for j in jobs],
      [
        "core_mixers_gqa-data.seed_3-seed_1",
        "core_mixers_kda_mla-data.seed_3-seed_1",
      ],
    )
    self.assertIn("--config.model.core_mixers=('kda','mla')", jobs[1].args)
    with self.assertRaisesRegex(ValueError, "swept twice"):
      xm_launch.build_jobs("c.py", "/r", ["seed=0,1", "config.seed=2"], [])
    with self.assertRaisesRegex(ValueError, "expected FIELD=V1,V2"):
      xm_launch.build_jobs("c.py", "/r", ["seed"], [])


@absltest.skipUnless(_has_xmanager(), "needs the optional extra: pip install -e '.[launch]'")
class XmLaunchObjectsTest(absltest.TestCase):
  """The non-dry-run path up to launching: the packageables, executors and jobs it builds."""

  def test_builds_local_and_vertex_executables_and_jobs(self):
    from xmanager import xm, xm_local

    xm_launch = _load_xm_launch()
    [job] = xm_launch.build_jobs("configs/benice.py:fixed", "/r", ["seed=3"], [])
    packageable, make_executor = xm_launch.make_executables(xm, xm_local, "local", python="py")
    self.assertEqual(packageable.executable_spec.path, "py")
    self.assertEqual(packageable.args.to_list(), ["-m", "looped.main"])
    self.assertEqual(packageable.env_vars["PYTHONPATH"], REPO)
    executor = make_executor({})
    self.assertIsInstance(executor, xm_local.Local)
    xm_job = xm_launch.make_job(xm, object(), executor, job)
    self.assertEqual(xm_job.name, "seed_3")
    self.assertEqual(
      xm_job.args.to_list(),
      ["--config=configs/benice.py:fixed", "--workdir=/r/seed_3", "--config.seed=3"],
    )

    packageable, make_executor = xm_launch.make_executables(
      xm, xm_local, "vertex", base_image="python:3.11", pip_install="jax[cuda12]"
    )
    spec = packageable.executable_spec
    self.assertEqual(spec.entrypoint, xm.ModuleName("looped.main"))
    self.assertEqual(spec.path, REPO)
    self.assertIn("RUN python -m pip install --no-cache-dir -e .", spec.docker_instructions)
    self.assertIn(
      "RUN python -m pip install --no-cache-dir 'jax[cuda12]'", spec.docker_instructions
    )
    from xmanager.cloud import vertex

    executor = make_executor(xm_launch.parse_requirements("A100=8"))
    self.assertIsInstance(executor, xm_local.Vertex)
    machine = vertex.get_machine_spec(xm_launch.make_job(xm, object(), executor, job))
    self.assertEqual((machine["accelerator_count"], machine["machine_type"]), (8, "a2-highgpu-8g"))
    executor = make_executor(xm_launch.parse_requirements("TPU_V3=8"))
    machine = vertex.get_machine_spec(xm_launch.make_job(xm, object(), executor, job))
    self.assertEqual((machine["accelerator_count"], machine["machine_type"]), (8, "cloud-tpu"))


class ShellLaunchersTest(testing.TempDirTestCase):
  def _dry_run(self, script, args, env):
    proc = subprocess.run(
      ["bash", os.path.join(LAUNCH, script), *args],
      capture_output=True,
      text=True,
      env={"PATH": os.environ["PATH"], "HOME": self.tmp, "DRY_RUN": "1", **env},
      timeout=30,
    )
    self.assertEqual(proc.returncode, 0, proc.stderr)
    self.assertEqual(proc.stdout.splitlines()[-1].split(":")[-1].strip(), "dry run, nothing run.")
    return proc.stdout.splitlines()

  def _run_task(self, task, env=None):
    """The shell command a worker would run, with `echo` as its Python: the argv it gets."""
    proc = subprocess.run(
      ["bash", "-c", task], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    self.assertEqual(proc.returncode, 0, proc.stderr)
    return proc.stdout.strip()

  def test_tpu_vm_runs_the_same_distributed_command_on_every_worker(self):
    flags = [
      "--config=configs/pretrain.py",
      "--workdir=/mnt/shared/run",
      "--config.model.core_mixers=('kda','mla')",
    ]
    lines = self._dry_run(
      "tpu_vm.sh",
      ["--tpu=my-tpu", "--zone=us-central2-b", f"--repo_dir={self.tmp}", "--", *flags],
      {"TPU_PROJECT": "proj", "PYTHON": "echo"},
    )
    gcloud = shlex.split(lines[1].removeprefix("tpu_vm.sh: "))
    self.assertEqual(
      gcloud[:-1],
      [
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "ssh",
        "my-tpu",
        "--zone=us-central2-b",
        "--project=proj",
        "--worker=all",
      ],
    )
    remote = gcloud[-1].removeprefix("--command=")
    self.assertEqual(lines[0], f"tpu_vm.sh: on every worker: {remote}")
    main = ["-m", "looped.main", "--jax_distributed", *flags]
    self.assertEqual(shlex.split(remote), ["cd", self.tmp, "&&", "echo", *main])
    self.assertEqual(self._run_task(remote), " ".join(main))

  def test_slurm_coordinator_is_the_first_node_and_each_task_gets_its_process_id(self):
    env = {
      "SLURM_JOB_ID": "1234",
      "SLURM_JOB_NODELIST": "node[03-05]",
      "SLURM_NNODES": "3",
      "SLURM_SUBMIT_DIR": self.tmp,
      "PYTHON": "echo",
    }
    flags = ["--config=configs/pretrain.py", "--workdir=/shared/a b"]
    lines = self._dry_run("slurm.sbatch", ["--", *flags], env)
    port = 1234 % 4096 + 61440  # jax's own SLURM default.
    self.assertEqual(lines[0], f"slurm.sbatch: coordinator node03:{port}, 3 processes (1 per node)")
    srun = shlex.split(lines[1].removeprefix("slurm.sbatch: "))
    self.assertEqual(
      srun[:-1], ["srun", "--nodes=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c"]
    )
    main = (
      f"-m looped.main --jax_distributed --coordinator_address=node03:{port} "
      "--num_processes=3 --process_id=2 --config=configs/pretrain.py --workdir=/shared/a b"
    )
    self.assertEqual(self._run_task(srun[-1], {"SLURM_PROCID": "2"}), main)

    # One process per GPU: 8 per node, each restricted to its local GPU as jax's detection does.
    lines = self._dry_run(
      "slurm.sbatch",
      ["--", *flags],
      {**env, "SLURM_JOB_NODELIST": "gpu[1,3-4],cpu7", "SLURM_NTASKS_PER_NODE": "8"},
    )
    self.assertIn("coordinator gpu1:", lines[0])
    task = shlex.split(lines[1].removeprefix("slurm.sbatch: "))[-1]
    self.assertIn("--num_processes=24 --process_id=$SLURM_PROCID", task)
    probe = task.replace("exec echo", 'echo "$JAX_LOCAL_DEVICE_IDS"; exec echo')
    self.assertEqual(
      self._run_task(probe, {"SLURM_PROCID": "13", "SLURM_LOCALID": "5"}).splitlines()[0], "5"
    )


class ConfigAgreementTest(absltest.TestCase):
  def _check(self, mine, everyone):
    """startup.check_processes_agree as process `mine` of `everyone` (config, workdir) pairs."""
    payloads = [startup.config_payload(c, w) for c, w in everyone]

    def gather_bytes(data):
      if data == hashlib.sha256(payloads[mine]).digest():
        return [hashlib.sha256(p).digest() for p in payloads]
      self.assertEqual(data, payloads[mine])
      return payloads

    startup.check_processes_agree(*everyone[mine], gather_bytes=gather_bytes)

  def test_processes_that_differ_are_named_with_the_first_differing_field(self):
    config = testing.smoke_config({})
    other = testing.smoke_config({"model.injection": "linear"})
    self._check(0, [(config, "w")] * 3)  # Agreement: no error.
    with self.assertRaisesRegex(
      ConfigError,
      r"process\(es\) \[2\] differ from process 0 of 3 \(first difference, process 0 vs 2: "
      r"config.model.injection = 'diagonal' vs 'linear'\)",
    ):
      self._check(1, [(config, "w"), (config, "w"), (other, "w")])
    with self.assertRaisesRegex(ConfigError, r"\[1, 2\] .*workdir = 'w' vs 'v'"):
      self._check(0, [(config, "w"), (config, "v"), (config, "v")])

  def test_payload_is_the_sorted_config_and_workdir(self):
    payload = json.loads(startup.config_payload(testing.smoke_config({}), "w"))
    self.assertEqual(payload["workdir"], "w")
    self.assertEqual(payload["config"]["train"]["num_steps"], 60)


class LocalMultiProcessTest(testing.TempDirTestCase):
  def test_two_processes_of_two_devices_train_and_only_process_0_writes_metrics(self):
    workdir = os.path.join(self.tmp, "run")
    proc = _local(
      "--num_processes=2", "--devices_per_process=2", "--", *TINY_RUN, f"--workdir={workdir}"
    )
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])
    for i in range(2):
      self.assertRegex(
        proc.stdout,
        rf"local.py: \[p{i}\] pid \d+: XLA_FLAGS='.*{FAST_COMPILE} "
        "--xla_force_host_platform_device_count=2'",
      )
      self.assertIn("--coordinator_address=localhost:", proc.stdout)
      self.assertRegex(
        proc.stdout,
        rf"\[p{i}\] .*jax.distributed: process index {i}, process count 2, 2 local of 4",
      )
      self.assertRegex(proc.stdout, rf"\[p{i}\] .*step 4/4 \| loss")
    self.assertIn("local.py: all 2 processes finished.", proc.stdout)
    self.assertEqual(os.listdir(os.path.join(workdir, "checkpoints")), ["4"])
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      steps = [json.loads(line)["step"] for line in f]
    self.assertEqual(steps, [2, 4])  # Once each: process 1 wrote nothing.

  def _two_processes_exiting_2(self, process_1_flag: str, name: str):
    """local.py with 2 processes, process 1 given one more flag; the run must exit with 2."""
    proc = _local(
      "--num_processes=2",
      f"--per_process_flags=1:{process_1_flag}",
      "--",
      *TINY_RUN,
      f"--workdir={os.path.join(self.tmp, name)}",
    )
    self.assertEqual(proc.returncode, 2, proc.stdout[-3000:] + proc.stderr[-3000:])
    return proc

  def test_a_failing_process_stops_the_others_and_is_named(self):
    # Process 1 misspells a field and exits before joining; process 0 would wait for it.
    proc = self._two_processes_exiting_2("--config.train.num_stepz=4", "bad")
    self.assertIn("[p1] error: --config.train.num_stepz=4: the config has no field", proc.stdout)
    self.assertIn(
      "local.py: process 1 of 2 failed with exit status 2; terminated the others.", proc.stderr
    )
    self.assertNotIn("Training steps", proc.stdout)

  def test_process_0_failing_alone_exits_at_once(self):
    # Only process 0 takes the workdir's lock; it must exit, not wait in jax.distributed's
    # shutdown for process 1, which has gone on towards training.
    workdir = os.path.join(self.tmp, "busy")
    with workdir_lock.WorkdirLock(workdir):
      proc = _local("--num_processes=2", "--", *TINY_RUN, f"--workdir={workdir}")
    self.assertEqual(proc.returncode, 2, proc.stdout[-3000:] + proc.stderr[-3000:])
    self.assertIn("[p0] error: ", proc.stdout)
    self.assertIn("is in use by another run", proc.stdout)
    self.assertIn("local.py: process 0 of 2 failed with exit status 2", proc.stderr)

  def test_sigterm_is_forwarded_and_no_process_outlives_local_py(self):
    proc = subprocess.Popen(
      [sys.executable, os.path.join(LAUNCH, "local.py"), "--num_processes=2", "--grace_s=2"]
      + ["--", *TINY_RUN, "--config.train.num_steps=100000"]
      + [f"--workdir={os.path.join(self.tmp, 'long')}"],
      cwd=REPO,
      env=LOCAL_ENV,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    pids, joined = [], 0
    try:
      for line in proc.stdout:  # Until both processes have joined jax.distributed.
        if match := re.match(r"local.py: \[p\d\] pid (\d+):", line):
          pids.append(int(match.group(1)))
        joined += "jax.distributed: process index" in line
        if joined == 2:
          break
      proc.send_signal(signal.SIGTERM)
      rest = proc.communicate(timeout=60)[0]
    finally:
      proc.kill()
    self.assertEqual(proc.returncode, 128 + signal.SIGTERM, rest[-3000:])
    self.assertIn("local.py: got signal 15, forwarding to the processes", rest)
    self.assertLen(pids, 2)
    for pid in pids:
      with self.assertRaises(ProcessLookupError):
        os.kill(pid, 0)

  def test_processes_given_different_configs_fail_before_training(self):
    proc = self._two_processes_exiting_2("--config.seed=1", "split")
    self.assertRegex(
      proc.stdout,
      r"\[p[01]\] error: processes disagree on the config or workdir: process\(es\) \[1\] differ "
      r"from process 0 of 2 \(first difference, process 0 vs 1: config.seed = 0 vs 1\)",
    )
    self.assertNotIn("Training steps", proc.stdout)
    self.assertRegex(proc.stderr, r"local.py: process [01] of 2 failed with exit status 2")


if __name__ == "__main__":
  absltest.main()
