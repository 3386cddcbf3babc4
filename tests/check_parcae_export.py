"""Outside CI: a looped model exported to the Parcae family (configs/export.py) runs in Parcae's
own public code with looped's logits.

A tiny random looped model with Parcae's fields (tests/convert_export_test.py's) is written as
a checkpoint and exported by the export program; a Python with torch and a checkout of Parcae's
public repository then loads the folder as its `parcae_lm.from_pretrained` does (config.json
without `_class_name` and `rope_settings` into ParcaeConfig, `pytorch_model.bin` by torch.load,
load_state_dict(strict=False)) and computes the logits from the same tokens and initial state
h_0 at R = 2 and 4. Prints the maximum absolute difference from looped's logits and the
logits' maximum magnitude; fails above 1e-4.

  python tests/check_parcae_export.py --parcae_python=VENV/bin/python --parcae_repo=PATH/parcae
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

_STEPS = (2, 4)
_TOLERANCE = 1e-4


def parcae_side(folder: str, inputs: str, out: str, repo: str) -> None:
  """In the torch Python: Parcae's logits of the exported folder."""
  import torch

  sys.path.insert(0, os.path.abspath(repo))
  from parcae_lm.models.parcae.config import ParcaeConfig

  with open(os.path.join(folder, "config.json")) as f:
    config = json.load(f)
  assert config.pop("_class_name") == "ParcaeConfig"
  config.pop("rope_settings", None)  # As from_pretrained does.
  model = ParcaeConfig(**config).construct_model()
  state = torch.load(
    os.path.join(folder, "pytorch_model.bin"), map_location="cpu", weights_only=True
  )
  missing, unexpected = model.load_state_dict(state, strict=False)
  assert set(missing) <= {"freqs_cis"} and not unexpected, (missing, unexpected)
  model.eval()
  data = np.load(inputs)
  ids, state0 = torch.tensor(data["input_ids"]).long(), torch.tensor(data["state0"])
  model.initialize_state = lambda input_embeds: state0.clone()
  logits = {}
  with torch.no_grad():
    for steps in _STEPS:
      got = model(ids, return_logits=True, num_steps_pair=torch.tensor([steps]))["logits"]
      logits[f"logits_r{steps}"] = got.float().numpy()
  np.savez(out, **logits, torch=np.array(torch.__version__))


def looped_side(args) -> int:
  import dataclasses

  import jax
  import jax.numpy as jnp

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import convert_export_test as export_test

  from looped.model import LoopedLM

  tmp = tempfile.mkdtemp()
  cfg = export_test.tiny_cfg(num_recurrences=4)
  params = export_test.random_params(cfg, seed=args.seed)
  export_test.write_checkpoint(os.path.join(tmp, "ckpt"), cfg, params)
  folder = os.path.join(tmp, "exported")
  export_test.export(os.path.join(tmp, "ckpt"), folder)
  rng = np.random.default_rng(args.seed)
  ids = rng.integers(0, 300, (2, 24)).astype(np.int32)  # The tokenizer's ids (<= vocab_size).
  state0 = (np.sqrt(2 / (5 * cfg.d_model)) * rng.standard_normal((2, 24, cfg.d_model))).astype(
    np.float32
  )
  inputs, out = os.path.join(tmp, "inputs.npz"), os.path.join(tmp, "parcae.npz")
  np.savez(inputs, input_ids=ids, state0=state0)
  here = os.path.abspath(__file__)
  command = [args.parcae_python, here, "--parcae_side", folder, inputs, out, args.parcae_repo]
  subprocess.run(command, check=True)
  parcae = np.load(out)
  worst = 0.0
  for steps in _STEPS:
    model = LoopedLM(dataclasses.replace(cfg, num_recurrences=steps))
    mine = np.asarray(
      jax.jit(model.apply)(params, jnp.asarray(ids), initial_state_BxTxD=jnp.asarray(state0))[0]
    )
    theirs = parcae[f"logits_r{steps}"]
    err = float(np.abs(mine - theirs).max())
    worst = max(worst, err)
    print(
      f"R = {steps}: max |looped - Parcae| = {err:.2e} (max |logit| {np.abs(theirs).max():.2f})"
    )
  print(f"jax {jax.__version__}, torch {parcae['torch']}")
  return 0 if worst <= _TOLERANCE else 1


def main() -> int:
  if len(sys.argv) > 1 and sys.argv[1] == "--parcae_side":
    parcae_side(*sys.argv[2:6])
    return 0
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--parcae_python", required=True, help="a Python with torch")
  p.add_argument("--parcae_repo", required=True, help="a checkout of Parcae's public repository")
  p.add_argument("--seed", type=int, default=0)
  return looped_side(p.parse_args())


if __name__ == "__main__":
  sys.exit(main())
