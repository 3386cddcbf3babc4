"""Writes tests/testdata/parcae_tiny/: a tiny random-weight Parcae saved by Parcae's own public
code as its publishers ship it (config.json with `_class_name`, weights in pytorch_model.bin,
written by torch.save), a byte-level tokenizer, and golden logits (golden.npz) from that code.

Run outside CI, with torch installed and a checkout of Parcae's public repository
(github.com/sandyresearch/parcae) on the path:

  python tests/make_parcae_vectors.py --parcae_repo=PATH/parcae

Parcae's config draws the initial recurrent state h_0 at random (state_init 'like-init'); the
draw used is saved as `state0` so that a reimplementation can start from the same h_0. Goldens
are the parallel forward's logits at R = 2 and 4 (`logits_r2`, `logits_r4`), evaluation mode.

With --dtype=bfloat16 (into tests/testdata/parcae_tiny_bf16) the same weights are rounded to
bfloat16 and saved as bfloat16 tensors (the RoPE buffer stays float32, as the public code keeps
it); the goldens come from that file loaded back the way from_pretrained loads it
(load_state_dict, strict=False) into the float32 model, so they are the float32 computation on
exactly the stored bfloat16 values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import make_looped_references as refs
import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))

# The released parcae-small-140m layout (configs/parcae/parcae-small-140m.py), shrunk
# (its architecture_class_name selects the config class here: ParcaeConfig).
TINY = dict(
  name="parcae-tiny",
  block_size=64,
  vocab_size=refs.VOCAB,
  padding_multiple=64,
  n_embd=32,
  num_attention_heads=2,
  num_key_value_heads=2,
  intermediate_size=48,
  bias=False,
  tie_embeddings=True,
  block_class_name="TransformerPreNormBlock",
  norm_class_name="RMSNorm",
  norm_eps=1e-5,
  mlp_class_name="BaseMLP",
  nonlin_name="ReLU2",
  qk_norm=True,
  logit_softcap=None,
  prelude_norm=True,
  init_strategy="scaled",  # The release's scaled-zero fails to construct (std-0 init).
  init_orthogonal=False,
  injection_type="diagonal",
  state_init="like-init",
  recurrent_embedding_dimension=32,
  recurrent_intermediation_embedding_dimension=48,
  n_layers_in_recurrent_block=2,
  n_layers_in_prelude=1,
  n_layers_in_coda=1,
  mean_recurrence=4,
  sampling_scheme="poisson-truncated-full",
  mean_backprop_depth=2,
  recurrent_iteration_method="per-sequence",
)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--parcae_repo", required=True, help="a checkout of Parcae's public repository")
  p.add_argument("--out", default=os.path.join(_HERE, "testdata", "parcae_tiny"))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  args = p.parse_args()
  torch = refs.need("torch")
  sys.path.insert(0, os.path.abspath(args.parcae_repo))
  from parcae_lm.models.parcae.config import ParcaeConfig

  torch.manual_seed(args.seed)
  os.makedirs(args.out, exist_ok=True)
  ids = torch.tensor(refs.write_tokenizer(args.out, ["<|pad|>", "<|begin_text|>", "<|end_text|>"]))
  config = ParcaeConfig(**{k: v for k, v in TINY.items() if k != "name"}, name=TINY["name"])
  model = config.construct_model().eval()
  with torch.no_grad():  # Random weights, not degenerate: Parcae's 1-D parameters included.
    g = torch.Generator().manual_seed(args.seed)
    for name, w in sorted(model.named_parameters()):
      if name.endswith(("A_log", "dt_bias")):
        w.copy_(0.5 * torch.randn(w.shape, generator=g))
      elif w.ndim == 1:  # RMSNorm weights
        w.copy_(1.0 + 0.3 * (2 * torch.rand(w.shape, generator=g) - 1))
      elif "wte" in name or "value_embeds" in name:
        w.copy_(0.5 * torch.randn(w.shape, generator=g))
      else:
        w.copy_(torch.randn(w.shape, generator=g) / w.shape[-1] ** 0.5)
      if args.dtype == "bfloat16":
        w.copy_(w.to(torch.bfloat16).float())

  # Saved as Parcae's save_pretrained does (config.json = asdict + _class_name), with the
  # weights under the name its publishers use and from_pretrained tries first.
  saved = dataclasses.asdict(config)
  saved["_class_name"] = type(config).__name__
  saved = json.loads(json.dumps(saved, default=str))
  with open(os.path.join(args.out, "config.json"), "w") as f:
    json.dump(saved, f, indent=2, sort_keys=True)
    f.write("\n")
  weights = os.path.join(args.out, "pytorch_model.bin")
  if args.dtype == "bfloat16":
    state = {
      k: v if k == "freqs_cis" else v.to(torch.bfloat16) for k, v in model.state_dict().items()
    }
    torch.save(state, weights)
    model = config.construct_model().eval()  # Loaded back from the file, as from_pretrained.
    model.load_state_dict(torch.load(weights, weights_only=True), strict=False)
  else:
    torch.save(model.state_dict(), weights)

  state0 = {}
  draw = model.initialize_state

  def recorded(input_embeds):
    if "x" not in state0:
      state0["x"] = draw(input_embeds)
    return state0["x"].clone()

  model.initialize_state = recorded
  golden = {"input_ids": ids.numpy().astype(np.int32)}
  with torch.no_grad():
    for steps in (2, 4):
      out = model(ids, return_logits=True, num_steps_pair=torch.tensor([steps]))
      golden[f"logits_r{steps}"] = refs.np32(out["logits"])
  golden["state0"] = refs.np32(state0["x"])
  meta = {"seed": args.seed, "torch": torch.__version__, "dtype": args.dtype}
  golden["meta"] = np.array(json.dumps(meta))
  np.savez_compressed(os.path.join(args.out, "golden.npz"), **golden)
  print(f"wrote {args.out}: {sorted(golden)}")


if __name__ == "__main__":
  main()
