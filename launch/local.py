r"""Runs N processes of `python -m looped.main` on this machine, joined by jax.distributed.

A multi-host run without a cluster: each process gets its own CPU devices and the flags that
name the coordinator (localhost, a free port), the process count and its id.

  python launch/local.py --num_processes=2 -- --config=configs/pretrain.py:smoke \
      --workdir=/tmp/smoke2 --config.train.num_steps=20

Everything after `--` goes to every process; `--per_process_flags=ID:FLAG` (repeatable) adds
FLAG to process ID only, e.g. to test that processes which disagree on the config fail.
Output lines are prefixed `[pID]`. If a process fails, the others are terminated and this
exits with its status, naming it; SIGINT/SIGTERM are forwarded to every process group (and
SIGKILL follows after --grace_s); if local.py itself is killed, so are they.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRAIN_S = 10.0  # The longest wait for an exited process's last output lines.


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=1, help="CPU devices each.")
  parser.add_argument("--port", type=int, default=0, help="Coordinator port (0: a free one).")
  parser.add_argument(
    "--platform", default="cpu", help="JAX_PLATFORMS of the processes ('' leaves it unset)."
  )
  parser.add_argument(
    "--grace_s",
    type=float,
    default=10.0,
    help="Seconds a stopped process gets before SIGKILL (jax.distributed's preemption "
    "notifier catches SIGTERM, so a training process usually takes them all).",
  )
  parser.add_argument(
    "--per_process_flags",
    action="append",
    default=[],
    metavar="ID:FLAG",
    help="A looped.main flag for process ID only (repeatable).",
  )
  parser.add_argument("main_flags", nargs="*", help="looped.main flags (after --).")
  args = parser.parse_args(argv)
  if args.num_processes < 1 or args.devices_per_process < 1:
    parser.error("--num_processes and --devices_per_process must be >= 1")
  extra: dict[int, list[str]] = {i: [] for i in range(args.num_processes)}
  for spec in args.per_process_flags:
    index, sep, flag = spec.partition(":")
    if not (sep and index.isdigit() and int(index) < args.num_processes):
      parser.error(f"--per_process_flags={spec}: expected ID:FLAG with ID < --num_processes")
    extra[int(index)].append(flag)
  args.extra = extra
  return args


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def commands(args: argparse.Namespace, port: int) -> list[tuple[dict, list[str]]]:
  """(environment overrides, argv) of each process."""
  count = "--xla_force_host_platform_device_count"
  xla_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)]
  out = []
  for i in range(args.num_processes):
    env = {
      "XLA_FLAGS": " ".join([*xla_flags, f"{count}={args.devices_per_process}"]),
      "PYTHONUNBUFFERED": "1",
    }
    if args.platform:
      env["JAX_PLATFORMS"] = args.platform
    argv = [
      sys.executable,
      "-m",
      "looped.main",
      "--jax_distributed",
      f"--coordinator_address=localhost:{port}",
      f"--num_processes={args.num_processes}",
      f"--process_id={i}",
      *args.main_flags,
      *args.extra[i],
    ]
    out.append((env, argv))
  return out


def _pump(index: int, stream, lock: threading.Lock) -> None:
  for line in stream:
    with lock:
      sys.stdout.write(f"[p{index}] {line}")
      sys.stdout.flush()


def _stop(procs: list[subprocess.Popen], grace_s: float, sig: int = signal.SIGTERM) -> None:
  """Sends `sig` to every live process group, then SIGKILL after grace_s."""
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, sig)
      except ProcessLookupError:
        pass
  deadline = time.time() + grace_s
  for p in procs:
    try:
      p.wait(timeout=max(deadline - time.time(), 0.1))
    except subprocess.TimeoutExpired:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      p.wait()


def _die_with_parent() -> None:
  """In the child (Linux): SIGKILL when local.py dies, even by SIGKILL, so none is orphaned
  (not SIGTERM: jax.distributed's preemption notifier catches it)."""
  if sys.platform.startswith("linux"):
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG.


def _exit_status(returncode: int) -> int:
  return returncode if returncode > 0 else 128 - returncode


def run(args: argparse.Namespace) -> int:
  port = args.port or free_port()
  # The children import looped from this checkout, whatever the caller's directory.
  pythonpath = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
  lock = threading.Lock()
  procs, pumps = [], []

  def forward(signum, _frame):
    print(f"local.py: got signal {signum}, forwarding to the processes", file=sys.stderr)
    _stop(procs, args.grace_s, signum)
    sys.exit(128 + signum)

  signal.signal(signal.SIGTERM, forward)
  signal.signal(signal.SIGINT, forward)
  for i, (env, argv) in enumerate(commands(args, port)):
    proc = subprocess.Popen(
      argv,
      env={**os.environ, **env, "PYTHONPATH": pythonpath},
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      start_new_session=True,  # Its own process group, so stopping it reaches its children.
      preexec_fn=_die_with_parent,  # Before any thread starts (preexec_fn and threads mix ill).
    )
    procs.append(proc)
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    print(f"local.py: [p{i}] pid {proc.pid}: {shown} {shlex.join(argv)}", flush=True)
  for i, proc in enumerate(procs):
    pump = threading.Thread(target=_pump, args=(i, proc.stdout, lock), daemon=True)
    pump.start()
    pumps.append(pump)

  while True:
    failed = next((i for i, p in enumerate(procs) if (p.poll() or 0) != 0), None)
    if failed is not None:
      pumps[failed].join(timeout=DRAIN_S)  # Its last lines (the error) before the verdict.
      others = [p for i, p in enumerate(procs) if i != failed and p.poll() is None]
      _stop(others, args.grace_s)
      for pump in pumps:
        pump.join(timeout=DRAIN_S)
      code = procs[failed].returncode
      print(
        f"local.py: process {failed} of {len(procs)} failed with exit status {code}; "
        f"terminated the others. Its command: {shlex.join(procs[failed].args)}",
        file=sys.stderr,
        flush=True,
      )
      return _exit_status(code)
    if all(p.poll() is not None for p in procs):
      for pump in pumps:
        pump.join(timeout=DRAIN_S)
      print(f"local.py: all {len(procs)} processes finished.", flush=True)
      return 0
    time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
  return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
  sys.exit(main())
