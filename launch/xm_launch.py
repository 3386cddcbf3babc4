r"""An XManager experiment: one work unit of `python -m looped.main` per point of a sweep.

  python launch/xm_launch.py --config=configs/benice.py:fixed --workdir_root=/tmp/sweep \
      --sweep=config.seed=0,1 --sweep=config.model.injection=linear,diagonal \
      --extra_flag=--config.train.num_steps=500 --dry_run

The work units are the cartesian product of the --sweep axes (FIELD=V1,V2,...; commas inside
brackets or quotes do not split). Each gets `--config.FIELD=V` flags and its own workdir,
<workdir_root>/<name built from its overrides>. `--dry_run` prints the jobs and launches
nothing; it and the job list need only absl, so they work without the xmanager extra
(`pip install -e '.[launch]'`), which is imported only to launch.

Executors (`--executor`):
  local   each work unit runs on this machine as a plain process (no Docker), with this
          Python interpreter (or --python) and the checkout on PYTHONPATH.
  vertex  Vertex AI custom jobs: the checkout is packaged as a Python container (built with
          Docker / Cloud Build from --base_image, which must have Python, then `pip install
          -e .` and --pip_install, e.g. 'jax[cuda12]') and each job asks for --requirements, e.g.
          `--requirements=A100=8` (GPUs) or `--requirements=TPU_V3=8` (TPU cores; xmanager
          0.8 maps only TPU_V2/V3 and picks machine types for A100 only: newer TPUs go
          through tpu_vm.sh). Needs gcloud credentials (`gcloud auth application-default
          login`, its project) and GOOGLE_CLOUD_BUCKET_NAME for the staged image. Vertex
          mounts buckets at /gcs/BUCKET, so --workdir_root=/gcs/BUCKET/sweep keeps the runs
          (looped writes workdirs with plain file I/O, not gs:// URLs).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shlex
import sys

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Job:
  name: str
  workdir: str
  overrides: tuple[tuple[str, str], ...]  # (FIELD without 'config.', value) per axis.
  args: tuple[str, ...]  # looped.main's flags.

  def command(self) -> list[str]:
    return ["python", "-m", "looped.main", *self.args]


def split_values(text: str) -> list[str]:
  """'0,1' -> ['0', '1']; commas inside (), [], {} or quotes stay: '(a,b),(c,)' -> 2 values."""
  values, depth, quote, current = [], 0, "", ""
  for ch in text:
    if quote:
      quote = "" if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      values.append(current)
      current = ""
      continue
    current += ch
  values.append(current)
  return values


def parse_sweep(spec: str) -> tuple[str, list[str]]:
  """'config.seed=0,1' -> ('seed', ['0', '1'])."""
  field, sep, values = spec.partition("=")
  field = field.strip().removeprefix("--").removeprefix("config.")
  if not (sep and field and values):
    raise ValueError(f"--sweep={spec}: expected FIELD=V1,V2,... e.g. config.seed=0,1")
  return field, split_values(values)


def _short_names(fields: list[str]) -> list[str]:
  """The shortest dotted suffix of each field that no other field ends with."""
  out = []
  for field in fields:
    parts = field.split(".")
    for n in range(1, len(parts) + 1):
      suffix = ".".join(parts[-n:])
      if all(f == field or not ("." + f).endswith("." + suffix) for f in fields):
        break
    out.append(suffix)
  return out


def job_name(overrides: tuple[tuple[str, str], ...], short: list[str]) -> str:
  """'seed_0-injection_linear': a directory name (characters outside [A-Za-z0-9._-] -> _)."""

  def clean(text):
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")

  return "-".join(f"{clean(n)}_{clean(v)}" for n, (_, v) in zip(short, overrides)) or "run"


def build_jobs(
  config: str, workdir_root: str, sweeps: list[str], extra_flags: list[str]
) -> list[Job]:
  """One Job per point of the cartesian product of `sweeps`, in the order given."""
  axes = [parse_sweep(s) for s in sweeps]
  fields = [field for field, _ in axes]
  if len(set(fields)) != len(fields):
    raise ValueError(f"--sweep: a field is swept twice: {fields}")
  short = _short_names(fields)
  jobs = []
  for point in itertools.product(*(values for _, values in axes)):
    overrides = tuple(zip(fields, point))
    name = job_name(overrides, short)
    workdir = os.path.join(workdir_root, name)
    args = (
      f"--config={config}",
      f"--workdir={workdir}",
      *(f"--config.{field}={value}" for field, value in overrides),
      *extra_flags,
    )
    jobs.append(Job(name, workdir, overrides, args))
  names = [j.name for j in jobs]
  if len(set(names)) != len(names):
    raise ValueError(f"two work units would share a workdir: {names}")
  return jobs


def describe(jobs: list[Job], executor: str) -> str:
  """What --dry_run prints: each work unit's name, overrides, workdir and command."""
  lines = [f"{len(jobs)} work units (executor: {executor})"]
  for i, job in enumerate(jobs, 1):
    lines.append(f"[{i}/{len(jobs)}] {job.name}")
    lines.append("  overrides: " + (" ".join(f"{f}={v}" for f, v in job.overrides) or "none"))
    lines.append(f"  workdir: {job.workdir}")
    lines.append(f"  command: {shlex.join(job.command())}")
  return "\n".join(lines)


def parse_requirements(spec: str) -> dict[str, int]:
  """'A100=8,ram=...' -> {'A100': 8}: the xm.JobRequirements keyword arguments."""
  out = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    name, sep, count = item.partition("=")
    if not (sep and count.isdigit()):
      raise ValueError(f"--requirements: {item!r} is not RESOURCE=N")
    out[name] = int(count)
  return out


def docker_instructions(pip_install: str) -> list[str]:
  """The image's build steps: the checkout under /app, installed with pip (xmanager's
  default steps expect a requirements.txt, which this repo does not have)."""
  name = os.path.basename(REPO)
  steps = [
    "ENV LANG=C.UTF-8",
    "RUN mkdir -p -m 775 /app && chown 1000:root /app",
    "WORKDIR /app",
    f"COPY --chown=1000:root {name}/ /app/{name}",
    f"WORKDIR /app/{name}",  # Relative --config paths resolve against the checkout.
    "RUN python -m pip install --no-cache-dir -e .",
  ]
  if pip_install:
    steps.append(f"RUN python -m pip install --no-cache-dir {shlex.quote(pip_install)}")
  return steps


def make_executables(
  xm, xm_local, executor: str, python: str = "", base_image: str = "", pip_install: str = ""
):
  """(packageable, executor factory): how a looped.main job is packaged and where it runs."""
  if executor == "local":
    packageable = xm.binary(
      executor_spec=xm_local.Local.Spec(),
      path=python or sys.executable,
      args=["-m", "looped.main"],
      env_vars={"PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"},
    )
    return packageable, lambda requirements: xm_local.Local(
      requirements=xm.JobRequirements(**requirements)
    )
  packageable = xm.python_container(
    executor_spec=xm_local.Vertex.Spec(),
    path=REPO,
    base_image=base_image,
    docker_instructions=docker_instructions(pip_install),
    entrypoint=xm.ModuleName("looped.main"),
    use_deep_module=True,
  )
  return packageable, lambda requirements: xm_local.Vertex(
    requirements=xm.JobRequirements(**requirements)
  )


def make_job(xm, executable, executor, job: Job):
  """The xm.Job of one work unit: the packaged looped.main with the unit's flags."""
  return xm.Job(executable=executable, executor=executor, args=list(job.args), name=job.name)


def launch(jobs: list[Job], executor: str, requirements: dict, title: str, **how):
  """Creates the experiment and adds one work unit per job (imports xmanager only here).

  how: python (local executor), base_image and pip_install (vertex): make_executables'.
  """
  from xmanager import xm, xm_local

  with xm_local.create_experiment(experiment_title=title) as experiment:
    packageable, make_executor = make_executables(xm, xm_local, executor, **how)
    [executable] = experiment.package([packageable])
    for job in jobs:
      experiment.add(make_job(xm, executable, make_executor(requirements), job))
      print(f"xm_launch: added work unit {job.name} (workdir {job.workdir})", flush=True)


def define_flags():
  """The command line's flags; only when run as a script, so tests can import this file."""
  flags.DEFINE_string(
    "config", None, "looped.main --config of every work unit, e.g. configs/benice.py:fixed."
  )
  flags.DEFINE_string(
    "workdir_root", None, "Each work unit's workdir is <workdir_root>/<its name>."
  )
  flags.DEFINE_multi_string(
    "sweep", [], "FIELD=V1,V2,...: one axis (work units: the cartesian product of the axes)."
  )
  flags.DEFINE_multi_string(
    "extra_flag", [], "A looped.main flag for every work unit, e.g. --config.train.num_steps=500."
  )
  flags.DEFINE_enum("executor", "local", ["local", "vertex"], "Where the jobs run.")
  flags.DEFINE_string(
    "requirements", "", "vertex: RESOURCE=N,..., e.g. A100=8 or TPU_V3=8 (xm.JobRequirements)."
  )
  flags.DEFINE_string(
    "python", "", "local: the interpreter that runs looped.main (default: this one)."
  )
  flags.DEFINE_string(
    "base_image", "python:3.11", "vertex: the container's base image (Python; CUDA for GPUs)."
  )
  flags.DEFINE_string(
    "pip_install", "", "vertex: packages added to the image, e.g. 'jax[cuda12]' or 'jax[tpu]'."
  )
  flags.DEFINE_string("experiment_title", "looped", "The XManager experiment's title.")
  flags.DEFINE_bool("dry_run", False, "Print the jobs it would create; launch nothing.")
  flags.mark_flags_as_required(["config", "workdir_root"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  try:
    jobs = build_jobs(f.config, f.workdir_root, f.sweep, f.extra_flag)
    requirements = parse_requirements(f.requirements)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  print(describe(jobs, f.executor), flush=True)
  if f.dry_run:
    print("xm_launch: --dry_run, nothing launched.")
    return
  launch(
    jobs,
    f.executor,
    requirements,
    f.experiment_title,
    python=f.python,
    base_image=f.base_image,
    pip_install=f.pip_install,
  )


if __name__ == "__main__":
  define_flags()
  app.run(main)
