"""One run per workdir: an exclusive lock file naming its holder (host, pid).

Two runs on one workdir would interleave metrics.jsonl and race on checkpoints. The lock is a
`flock` on WORKDIR/.lock, which the kernel releases when the holder dies (even by SIGKILL), so a
stale file is taken over with a warning naming the dead holder, and a live holder makes the
second run fail at once with its host and pid.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from absl import logging

LOCK_NAME = ".lock"


class WorkdirBusyError(RuntimeError):
  """Another live process holds the workdir."""


class WorkdirLock:
  """Context manager holding WORKDIR/.lock for the life of a run."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_NAME)
    self._fd: int | None = None

  def acquire(self) -> WorkdirLock:
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _read(fd)
      os.close(fd)
      raise WorkdirBusyError(
        f"{os.path.dirname(self.path)} is in use by another run (host {holder.get('host', '?')}, "
        f"pid {holder.get('pid', '?')}, since {holder.get('started', '?')}). Wait for it, stop "
        "it, or use another --workdir."
      ) from None
    previous = _read(fd)
    if previous:
      logging.warning(
        "Taking over the stale lock %s of a run that is no longer alive (host %s, pid %s).",
        self.path,
        previous.get("host", "?"),
        previous.get("pid", "?"),
      )
    record = {
      "host": socket.gethostname(),
      "pid": os.getpid(),
      "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is None:
      return
    os.ftruncate(self._fd, 0)  # An empty file is not stale: the next run takes it quietly.
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None

  def __enter__(self) -> WorkdirLock:
    return self if self._fd is not None else self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _read(fd: int) -> dict:
  try:
    text = os.pread(fd, 4096, 0).decode("utf-8", errors="replace").strip()
    return json.loads(text) if text else {}
  except (OSError, json.JSONDecodeError):
    return {"host": "?", "pid": "? (unreadable lock file)"}
