"""ml_collections configs: one `get_config(arg)` per file; `VARIANTS` lists its args.

A config is made of sections (config.model, config.train, ...), each declared once by a schema
dataclass (looped.schema): a config file starts a section from its schema's defaults and sets
only what it changes. SECTIONS says which schema each section path follows, for `--help`.
"""

from looped.benice.config import BeniceConfig, EvalConfig, PipelineConfig
from looped.convert.config import ConvertConfig, ExportConfig
from looped.data.config import DataConfig
from looped.engine.config import GenConfig
from looped.model.config import ModelConfig
from looped.server.config import ServeConfig
from looped.sharding import MeshConfig
from looped.sim.config import SessionsConfig, SimConfig, SyntheticConfig
from looped.train.config import DepthConfig, TrainConfig

SECTIONS = {
  "model": ModelConfig,
  "data": DataConfig,
  "mesh": MeshConfig,
  "depth": DepthConfig,
  "train": TrainConfig,
  "post.depth": DepthConfig,  # Post-training's depth (configs/benice.py).
  "post.train": TrainConfig,  # Post-training's fields over config.train's.
  "benice": BeniceConfig,
  "eval": EvalConfig,
  "pipeline": PipelineConfig,
  "gen": GenConfig,
  "serve": ServeConfig,
  "sim": SimConfig,
  "synthetic": SyntheticConfig,
  "sessions": SessionsConfig,
  "convert": ConvertConfig,
  "export": ExportConfig,
}


def parse_args(arg: str, variants: dict[str, str]) -> set[str]:
  """The set of variants in `arg` ('smoke,fixed'); ValueError naming the allowed ones."""
  args = {a for a in arg.split(",") if a}
  unknown = args - set(variants)
  if unknown:
    allowed = ", ".join(f"'{v}'" for v in variants)
    raise ValueError(f"unknown config variant(s) {sorted(unknown)}; allowed: {allowed}.")
  return args
