"""Importing public looped checkpoints (Hugging Face layout) as LoopedLM checkpoints.

hf_folder.py reads the folder; one module per family maps its config and weights (huginn.py,
ouro.py); program.py is the `convert` program (configs/convert.py, docs/convert.md).
"""

from looped.convert import huginn, ouro

FAMILIES = {arch: module for module in (huginn, ouro) for arch in module.ARCHITECTURES}


def family(architecture: str):
  """The family module converting `architecture`; ConfigError naming the supported ones."""
  from looped import config_checks as cc

  if architecture not in FAMILIES:
    raise cc.ConfigError(
      f"config.json architectures = [{architecture!r}] is not supported; supported: "
      f"{', '.join(sorted(FAMILIES))}."
    )
  return FAMILIES[architecture]
