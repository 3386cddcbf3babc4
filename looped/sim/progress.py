"""A dependency-free progress bar on stderr (a line per quarter when stderr is not a terminal)."""

from __future__ import annotations

import sys
import time


class Progress:
  """Shows done/total, rate and ETA; redraws at most a few times a second."""

  def __init__(self, total: int, label: str, *, stream=None, width: int = 30):
    self.total = max(total, 1)
    self.label = label
    self._stream = stream or sys.stderr
    self._tty = getattr(self._stream, "isatty", lambda: False)()
    self._width = width
    self._start = time.monotonic()
    self._last_draw = 0.0
    self._last_quarter = -1

  def update(self, done: int, note: str = "") -> None:
    now = time.monotonic()
    quarter = 4 * done // self.total
    if self._tty and now - self._last_draw < 0.2 and done < self.total:
      return
    if not self._tty and quarter == self._last_quarter:
      return
    self._last_draw, self._last_quarter = now, quarter
    elapsed = now - self._start
    eta = elapsed / done * (self.total - done) if done else float("nan")
    filled = self._width * done // self.total
    bar = "#" * filled + "." * (self._width - filled)
    line = (
      f"{self.label} [{bar}] {done}/{self.total} {elapsed:5.1f}s elapsed, ETA {eta:5.1f}s {note}"
    )
    self._stream.write(("\r" + line) if self._tty else line + "\n")
    self._stream.flush()

  def close(self) -> None:
    if self._tty:
      self._stream.write("\n")
      self._stream.flush()
