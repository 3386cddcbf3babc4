"""Writes tests/testdata/huginn_tiny/adaptive.json: greedy generations of Huginn's public
`generate_with_adaptive_compute` on the tiny checkpoint, one per exit criterion and setting,
with the recurrences every generated token ran.

  python tests/make_adaptive_references.py --huginn_modeling_file=PATH/raven_modeling_minimal.py

The modeling file (seal-rg/recurrent-pretraining, recpre/raven_modeling_minimal.py, with
raven_config_minimal.py beside it) is imported from its own directory, as
tests/make_looped_references.py does, and is not part of this repository; its version and the
libraries used are in tests/testdata/LOOPED_REFERENCES.md ("Adaptive exit"). It needs torch,
transformers < 4.58 (the modeling file's own generation API), safetensors and numpy. Every run
is batch 1 (the reference's own advice for adaptive compute), float32, greedy, zero initial
state (init_scale=0) and the default cache (lookup_strategy 'full': a token attends only to
earlier tokens that ran the same recurrence). The recurrences a token ran are counted as the
reference's core steps between two of its `embed_inputs` calls (one per generated token), by
wrapping the two methods on the model instance; nothing else of the reference is touched.
"""

from __future__ import annotations

import argparse
import json
import os

import make_looped_references as refs
import numpy as np

TINY = os.path.join(refs.TESTDATA, "huginn_tiny")
PROMPT_TOKENS = 8  # The first tokens of each golden input row.
NEW_TOKENS = 10
# name -> generate_with_adaptive_compute's arguments. Thresholds are chosen so that tokens
# exit at several depths on the tiny random model (its "auto" thresholds, except where noted,
# keep every token at full depth or at the first check, which would test little).
CASES = {
  "none_r3": dict(criterion="none", num_steps=3),
  "none_r8": dict(criterion="none", num_steps=8),
  "entropy-diff": dict(criterion="entropy-diff", exit_threshold=2e-2, num_steps=8),
  "latent-diff": dict(criterion="latent-diff", exit_threshold=0.65, num_steps=8),
  "kl": dict(criterion="kl", exit_threshold=0.25, num_steps=8),
  "minp-kl": dict(criterion="minp-kl", exit_threshold=0.1, num_steps=8),
  "argmax-stability": dict(criterion="argmax-stability", exit_threshold=1, num_steps=8),
  "cosine": dict(criterion="cosine", exit_threshold=0.25, num_steps=8),
  "kl_min_steps2": dict(criterion="kl", exit_threshold=0.25, num_steps=8, min_steps=2),
  "latent-diff_every2": dict(
    criterion="latent-diff", exit_threshold=0.65, num_steps=8, check_criterion_every_n_steps=2
  ),
  "kl_continuous": dict(criterion="kl", exit_threshold=0.25, num_steps=8, continuous_compute=True),
  "latent-diff_continuous": dict(
    criterion="latent-diff", exit_threshold=0.65, num_steps=8, continuous_compute=True
  ),
  "entropy-diff_no_prefill_exit": dict(
    criterion="entropy-diff", exit_threshold=2e-2, num_steps=8, do_not_exit_in_prefill=True
  ),
}


def count_steps(model) -> list[int]:
  """Wraps the instance's embed_inputs (one call per generated token, plus one with continuous
  compute before the first) and iterate_one_step (one core recurrence); returns the list that
  gets each call's recurrence count."""
  counts: list[int] = []
  embed, step = model.embed_inputs, model.iterate_one_step

  def embed_inputs(*args, **kwargs):
    counts.append(0)
    return embed(*args, **kwargs)

  def iterate_one_step(*args, **kwargs):
    counts[-1] += 1
    return step(*args, **kwargs)

  model.embed_inputs, model.iterate_one_step = embed_inputs, iterate_one_step
  return counts


def generate(torch, model, counts, prompt: list[int], case: dict) -> tuple[list[int], list[int]]:
  from transformers import GenerationConfig

  config = GenerationConfig(do_sample=False, return_dict_in_generate=True, pad_token_id=0)
  counts.clear()
  ids = torch.tensor([prompt])
  out = model.generate_with_adaptive_compute(
    ids, config, max_new_tokens=NEW_TOKENS, init_scale=0.0, **case
  )
  tokens = out.sequences[0, len(prompt) :].tolist()
  steps = [c for c in counts if c]  # Continuous compute's first embed_inputs runs no step.
  assert len(tokens) == len(steps) == NEW_TOKENS, (tokens, steps)
  return tokens, steps


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--huginn_modeling_file", required=True)
  parser.add_argument("--out", default=os.path.join(TINY, "adaptive.json"))
  args = parser.parse_args()
  torch = refs.need("torch")
  refs.need("transformers")
  module = refs.load_reference(args.huginn_modeling_file, "huginn_reference")
  model = module.RavenForCausalLM.from_pretrained(TINY, torch_dtype=torch.float32)
  model.eval()
  counts = count_steps(model)
  golden = np.load(os.path.join(TINY, "golden.npz"))
  prompts = [row[:PROMPT_TOKENS].tolist() for row in golden["input_ids"]]
  cases = {}
  for name, case in CASES.items():
    runs = [generate(torch, model, counts, p, case) for p in prompts]
    cases[name] = {
      "settings": case,
      "tokens": [t for t, _ in runs],
      "recurrences": [s for _, s in runs],
    }
    print(name, [s for _, s in runs])
  import transformers

  meta = {
    "source": "seal-rg/recurrent-pretraining recpre/raven_modeling_minimal.py",
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "numpy": np.__version__,
    "init_scale": 0.0,
    "cache_lookup_strategy": "full",
    "new_tokens": NEW_TOKENS,
  }
  with open(args.out, "w") as f:
    json.dump({"meta": meta, "prompts": prompts, "cases": cases}, f, indent=1)
    f.write("\n")
  print("wrote", args.out)


if __name__ == "__main__":
  main()
