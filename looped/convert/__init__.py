"""Importing public looped checkpoints (Hugging Face layout) as LoopedLM checkpoints, and
exporting LoopedLM checkpoints as Parcae, Huginn, Ouro or looped folders.

hf_folder.py reads the folder (torch_bin.py its pytorch_model.bin, safely); one module per
family maps its config and weights (huginn.py, ouro.py, parcae.py, looped_family.py); program.py
is the `convert` program (configs/convert.py, docs/convert.md). parcae_export.py,
huginn_export.py, ouro_export.py and looped_export.py invert their family's mapping (the looped
family's PyTorch modeling code, copied into its folders, is hf_looped/), tokenizer_files.py
writes the tokenizer files and names the token ids, torch_save.py writes torch.save's format
without torch, export.py is the `export` program (configs/export.py).
"""

from looped.convert import huginn, looped_family, ouro, parcae

FAMILIES = {
  arch: module for module in (huginn, ouro, parcae, looped_family) for arch in module.ARCHITECTURES
}


def family(architecture: str):
  """The family module converting `architecture`; ConfigError naming the supported ones."""
  from looped import config_checks as cc

  if architecture not in FAMILIES:
    raise cc.ConfigError(
      f"config.json architectures = [{architecture!r}] is not supported; supported: "
      f"{', '.join(sorted(a for a, m in FAMILIES.items() if getattr(m, 'CONVERTS', True)))}."
    )
  return FAMILIES[architecture]
