"""The BeNice! pipeline sized for the runtime it runs on (the Colab quickstart's config).

  python -m looped.main --config=configs/colab.py --workdir=/tmp/colab          # this machine
  python -m looped.main --config=configs/colab.py:small --workdir=/tmp/colab    # smoke, anywhere

Args: `small` (the smoke pipeline on any runtime). Fields: those of configs/benice.py, resized
by `benice_config` below. The Colab notebooks (colabs/) call `detect()` then `benice_config()`;
both take plain values so the choice can be tested with faked device lists (a TPU v2-8 runtime
has 8 devices of kind 'TPU v2', a GPU runtime one 'Tesla T4' or similar, a CPU runtime one
'cpu').
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ml_collections

import configs
from configs import benice

VARIANTS = {"small": "the smoke pipeline on any runtime (the notebooks' SMALL = True)"}


@dataclasses.dataclass(frozen=True)
class Runtime:
  platform: str  # 'tpu', 'gpu' or 'cpu' (jax.Device.platform; 'cuda'/'rocm' read as 'gpu').
  num_devices: int  # Devices this process sees.
  device_kind: str  # e.g. 'TPU v2', 'TPU v5 lite', 'NVIDIA A100-SXM4-40GB', 'cpu'.

  def describe(self) -> str:
    return f"{self.num_devices} x {self.device_kind} ({self.platform})"


def detect(devices: Sequence | None = None) -> Runtime:
  """The runtime of `devices` (default: jax.devices()); all devices are assumed alike."""
  if devices is None:
    import jax  # Imported here so that faked device lists need no backend.

    devices = jax.devices()
  if not devices:
    raise ValueError("no devices: jax.devices() returned an empty list")
  first = devices[0]
  platform = {"cuda": "gpu", "rocm": "gpu"}.get(first.platform, first.platform)
  if platform not in ("tpu", "gpu", "cpu"):
    raise ValueError(f"unknown device platform {first.platform!r} (expected tpu, gpu or cpu)")
  return Runtime(platform, len(devices), str(getattr(first, "device_kind", platform)))


def benice_config(runtime: Runtime, small: bool = False) -> ml_collections.ConfigDict:
  """The pipeline config for a runtime: the smoke pipeline on a CPU (or when `small`), the
  default CPU-sized pipeline on one GPU, and a wider, longer model trained with bf16 compute
  on a TPU runtime (8 cores on v2-8 / v3-8 / v5e-8), its batch split over the cores."""
  if small or runtime.platform == "cpu":
    return benice.get_config("smoke")
  c = benice.get_config("")
  c.model.dtype = "bfloat16"  # Accelerator recipe: bf16 compute, fp32 master params.
  if runtime.platform == "tpu":
    m = c.model  # Wider: 8 query heads and 4 KV heads of 64, MLP 3 d_model.
    m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 512, 8, 4, 64, 1536
    m.max_seq_len = 512  # Longer rows.
    c.data.seq_len = 512  # Tokens per row: the model's whole context.
    per_core = 8
    c.data.batch_size = per_core * runtime.num_devices  # Divisible by the data axis.
    c.data.eval_batch_size = per_core * runtime.num_devices  # Likewise.
    c.train.num_steps = 2000  # Pretraining steps.
    c.post.train.num_steps = 400  # Post-training steps (both arms).
  return c


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  """benice_config for the runtime this process sees (jax.devices())."""
  args = configs.parse_args(arg, VARIANTS)
  return benice_config(detect(), small="small" in args)
