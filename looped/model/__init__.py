"""The looped LM, its decode cache and its KV-sharing forwards."""

from looped.model import flops
from looped.model.config import ModelConfig, from_config, validate
from looped.model.kv_cache import KVCache, init_cache
from looped.model.looped_lm import LoopedLM, init_params

__all__ = [
  "KVCache",
  "LoopedLM",
  "ModelConfig",
  "from_config",
  "init_cache",
  "flops",
  "init_params",
  "validate",
]
