"""Outside CI: looped models exported to the Huginn and Ouro families (configs/export.py,
export.family) run in each family's own public code with looped's logits.

For each family, three models are exported by the export program: the tiny folder its public code
wrote (tests/testdata/{huginn,ouro}_tiny) converted to a looped checkpoint; a random looped model
the family expresses (tests/convert_export_looped_test.py's fields, every param 0.5 N(0, 1);
Huginn's computing its RoPE angles, model.rope_table=False, as a model trained by looped does); and
a model initialized and trained by looped's trainer (configs/pretrain.py:smoke with the family's
fields, TRAINED, --train_steps steps). A Python with torch and transformers then imports the
family's modeling file (as tests/make_looped_references.py does, as a package beside its config
module), loads the exported folder with the class's own `from_pretrained` (model.safetensors; no
missing or unexpected tensor) and computes the logits from the same tokens at R = 2 and 4: Huginn's
`forward(input_ids, input_states=h_0, num_steps=R)` from the same h_0 as looped, Ouro's
`forward(input_ids, exit_at_step=R - 1)` with total_ut_steps = R. Prints the maximum absolute
difference from looped's logits and the logits' maximum magnitude; fails above 1e-4.

  python tests/check_looped_export.py --torch_python=VENV/bin/python \
      --huginn_modeling_file=PATH/raven_modeling_minimal.py \
      --ouro_modeling_file=PATH/modeling_ouro.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

_STEPS = (2, 4)
_TOLERANCE = 1e-4
_HERE = os.path.dirname(os.path.abspath(__file__))


def reference_side(family: str, modeling_file: str, folder: str, inputs: str, out: str) -> None:
  """In the torch Python: the public code's logits of the exported folder."""
  import torch

  sys.path.insert(0, _HERE)
  from make_looped_references import load_reference

  data = np.load(inputs)
  ids = torch.tensor(data["input_ids"]).long()
  logits = {}
  if family == "huginn":
    ref = load_reference(modeling_file, "huginn_reference")
    model, info = ref.RavenForCausalLM.from_pretrained(
      folder, dtype=torch.float32, output_loading_info=True
    )
    state0 = torch.tensor(data["state0"])
    run = lambda steps: model(input_ids=ids, input_states=state0, num_steps=steps).logits
  else:
    ref = load_reference(modeling_file, "ouro_reference")
    model, info = ref.OuroForCausalLM.from_pretrained(
      folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )

    def run(steps: int):
      model.config.total_ut_steps = model.model.config.total_ut_steps = steps
      model.model.total_ut_steps = steps
      o = model(input_ids=ids, use_cache=False, exit_threshold=None, exit_at_step=steps - 1)
      return o.logits

  missing = [n for n in info["missing_keys"] if n != "lm_head.weight"]  # Tied: the embedding.
  assert not missing and not info["unexpected_keys"], info
  model.eval()
  with torch.no_grad():
    for steps in _STEPS:
      logits[f"logits_r{steps}"] = run(steps).float().numpy()
  np.savez(out, **logits, torch=np.array(torch.__version__))


def _export(checkpoint: str, out: str, family: str) -> None:
  from configs import export as export_config
  from looped import programs

  config = export_config.get_config()
  config.export.checkpoint = checkpoint
  config.export.family = family
  programs.run(config, out)


# Model fields over configs/pretrain.py:smoke's (width 64, 2 heads of 32) each family expresses.
TRAINED = {
  "huginn": {
    "num_kv_heads": 2,
    "injection": "linear",
    "block_norm": "post",
    "prelude_norm": False,
    "qk_norm": False,
    "qk_bias": True,
    "embed_scale": 8.0,  # sqrt(d_model)
    "core_out_norm": "final",
    "state_init_std": (2 / 5) ** 0.5,  # sqrt(2 / 5 D) * sqrt(D)
    "rope_base": 50000.0,
  },
  "ouro": {
    "num_prelude_layers": 0,
    "num_coda_layers": 0,
    "injection": "none",
    "state_init": "embed",
    "block_norm": "sandwich",
    "core_out_norm": "every",
    "exit_gate": True,
    "prelude_norm": False,
    "qk_norm": False,
  },
}


def _recorded(workdir: str):
  """(ModelConfig, params) of the checkpoint in `workdir`, from its record."""
  import ml_collections

  import looped_testing as testing
  from looped.checkpoints import model_record
  from looped.model import from_config

  fields = model_record.read(workdir)["model"]
  model_cfg = ml_collections.ConfigDict(
    {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
  )
  return from_config(model_cfg), testing.saved_params(model_cfg, workdir)


def _models(family: str, tmp: str, seed: int, train_steps: int):
  """(name, ModelConfig, params, checkpoint dir): the converted tiny folder, a random looped
  model, and a model trained by the trainer (configs/pretrain.py:smoke, `train_steps` steps)."""
  import convert_export_looped_test as looped_test
  import convert_export_test as parcae_test

  tiny = os.path.join(tmp, f"{family}_tiny")
  cfg, params = parcae_test.convert(os.path.join(_HERE, "testdata", f"{family}_tiny"), tiny)
  yield "converted tiny", cfg, params, tiny
  changes = {"rope_table": False} if family == "huginn" else {}
  cfg = looped_test.tiny_cfg(family, **changes)
  params = looped_test.looped_params(cfg, seed)
  ckpt = os.path.join(tmp, f"{family}_random")
  parcae_test.write_checkpoint(ckpt, cfg, params)
  yield "random looped", cfg, params, ckpt
  if not train_steps:
    return
  trained = os.path.join(tmp, f"{family}_trained")
  command = [sys.executable, "-m", "looped.main", "--config=configs/pretrain.py:smoke"]
  command += [f"--workdir={trained}", f"--config.train.num_steps={train_steps}"]
  command += [f"--config.model.{k}={v}" for k, v in TRAINED[family].items()]
  subprocess.run(command, check=True, cwd=os.path.dirname(_HERE), capture_output=True)
  yield f"trained {train_steps} steps", *_recorded(trained), trained


def looped_side(args) -> int:
  import dataclasses

  import jax
  import jax.numpy as jnp

  sys.path.insert(0, _HERE)
  from looped.model import LoopedLM

  tmp = tempfile.mkdtemp()
  worst = 0.0
  for family in ("huginn", "ouro"):
    modeling_file = getattr(args, f"{family}_modeling_file")
    for name, cfg, params, ckpt in _models(family, tmp, args.seed, args.train_steps):
      folder = ckpt + "_exported"
      _export(ckpt, folder, family)
      rng = np.random.default_rng(args.seed)
      ids = rng.integers(0, min(300, cfg.vocab_size), (2, 24)).astype(np.int32)
      std = cfg.state_init_std if cfg.state_init == "like_init" else 1.0
      state0 = (std * rng.standard_normal((2, 24, cfg.d_model))).astype(np.float32)
      inputs, out = os.path.join(tmp, "inputs.npz"), os.path.join(tmp, "reference.npz")
      np.savez(inputs, input_ids=ids, state0=state0)
      command = [args.torch_python, os.path.abspath(__file__), "--reference_side", family]
      subprocess.run(command + [modeling_file, folder, inputs, out], check=True)
      reference = np.load(out)
      for steps in _STEPS:
        model = LoopedLM(dataclasses.replace(cfg, num_recurrences=steps))
        h0 = {"initial_state_BxTxD": jnp.asarray(state0)} if family == "huginn" else {}
        mine = np.asarray(jax.jit(model.apply)(params, jnp.asarray(ids), **h0)[0])
        theirs = reference[f"logits_r{steps}"]
        err = float(np.abs(mine - theirs).max())
        worst = max(worst, err)
        print(
          f"{family} {name}, R = {steps}: max |looped - reference| = {err:.2e} "
          f"(max |logit| {np.abs(theirs).max():.2f})"
        )
  print(f"jax {jax.__version__}, torch {reference['torch']}")
  return 0 if worst <= _TOLERANCE else 1


def main() -> int:
  if len(sys.argv) > 1 and sys.argv[1] == "--reference_side":
    reference_side(*sys.argv[2:7])
    return 0
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--torch_python", required=True, help="a Python with torch and transformers")
  p.add_argument("--huginn_modeling_file", required=True, help="raven_modeling_minimal.py")
  p.add_argument("--ouro_modeling_file", required=True, help="modeling_ouro.py")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--train_steps", type=int, default=20, help="0: no trained model")
  return looped_side(p.parse_args())


if __name__ == "__main__":
  sys.exit(main())
