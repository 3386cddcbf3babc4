"""Metrics to WORKDIR/metrics.jsonl (one JSON object per record) and TensorBoard event files."""

from __future__ import annotations

import json
import os

import numpy as np
from absl import logging


def _to_python(value):
  arr = np.asarray(value)
  return arr.item() if arr.ndim == 0 else arr.tolist()


class MetricsWriter:
  """Appends records; on resume, drops records newer than the restored checkpoint.

  Records logged after the last checkpoint of a killed run describe work that was lost and
  will be redone, so keeping them would duplicate steps in the file.
  """

  def __init__(self, workdir: str, resume_step: int, enabled: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    if os.path.exists(self.path):
      kept = [r for r in read_metrics(workdir) if r["step"] <= resume_step]
      with open(self.path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    from tensorboardX import SummaryWriter

    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1)

  def write(self, step: int, metrics: dict) -> dict:
    record = {"step": int(step)}
    record.update({k: _to_python(v) for k, v in metrics.items()})
    if not self.enabled:
      return record
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    for name, value in record.items():
      if name == "step":
        continue
      if isinstance(value, list):
        for i, v in enumerate(value):
          self._tb.add_scalar(f"{name}/{i}", v, step)
      else:
        self._tb.add_scalar(name, value, step)
    self._tb.flush()
    return record

  def close(self):
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  """The records of WORKDIR/metrics.jsonl; a torn line (a crash mid-write) is skipped."""
  path = os.path.join(workdir, "metrics.jsonl")
  records = []
  with open(path, encoding="utf-8", errors="replace") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        logging.warning("%s:%d is not a complete JSON record (torn write?); skipped.", path, lineno)
        continue
      if isinstance(record, dict) and isinstance(record.get("step"), int):
        records.append(record)
  return records
