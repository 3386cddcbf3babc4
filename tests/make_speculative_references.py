"""Writes tests/testdata/huginn_tiny/speculative.json: greedy generations of Huginn's public
`generate_speculative` on the tiny checkpoint, with the tokens each round accepted, and the
plain greedy tokens of its `generate` at the verifier's depth.

  python tests/make_speculative_references.py --huginn_modeling_file=PATH/raven_modeling_minimal.py

The modeling file is imported from its own directory, as tests/make_adaptive_references.py
does (same file, requirements and settings: batch 1, float32, greedy, init_scale=0, the default
cache with lookup_strategy 'full'); versions are in tests/testdata/LOOPED_REFERENCES.md
("Speculative decoding"). Nothing of the reference's algorithm is reimplemented. The tokens
accepted per round are read from its cache trims: `generate_speculative` builds its own
`HuginnDynamicCache`, so the class's `clear_last_k_entries` is wrapped to log each call's k.
Every round first drops its `lookahead` draft entries (k = lookahead), then, when the verifier
disagreed at draft j (0-based), the verified entries after it (k = lookahead - j - 1), keeping
the j + 1 accepted ones; so a round accepts lookahead minus its second k (0 when absent). The
model's forward calls are counted too, and both counts are checked against each other and the
returned tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import make_adaptive_references as adaptive_refs
import make_looped_references as refs
import numpy as np

NEW_TOKENS = 16  # max_new_tokens; a round may overshoot it (see `meta`).
# name -> generate_speculative's arguments. On the tiny random model shallow drafts mostly
# disagree at once (rounds of 1 token); deeper ones make rounds accept 1 up to every draft, and
# drafts at the verifier's depth accept every draft of every round.
CASES = {
  "d1_k4_r4": dict(draft_steps=1, lookahead_for_draft=4, num_steps=4),
  "d2_k3_r4": dict(draft_steps=2, lookahead_for_draft=3, num_steps=4),
  "d3_k5_r4": dict(draft_steps=3, lookahead_for_draft=5, num_steps=4),
  "d4_k3_r4": dict(draft_steps=4, lookahead_for_draft=3, num_steps=4),
  "d1_k2_r8": dict(draft_steps=1, lookahead_for_draft=2, num_steps=8),
  "d6_k4_r8": dict(draft_steps=6, lookahead_for_draft=4, num_steps=8),
  "d7_k3_r8": dict(draft_steps=7, lookahead_for_draft=3, num_steps=8),
}
MAX_LOOKAHEAD = max(c["lookahead_for_draft"] for c in CASES.values())
# Plain greedy tokens recorded: as many as any speculative run can return.
GREEDY_TOKENS = NEW_TOKENS + MAX_LOOKAHEAD - 1


def instrument(module, model) -> tuple[list[int], list[int]]:
  """Logs each cache trim's k and each forward call's token count (lists, filled by later
  calls): wraps HuginnDynamicCache.clear_last_k_entries on the class and forward on the
  instance."""
  clears: list[int] = []
  calls: list[int] = []
  cache_cls = module.HuginnDynamicCache
  clear, forward = cache_cls.clear_last_k_entries, model.forward

  def clear_last_k_entries(self, k: int = 0):
    clears.append(int(k))
    return clear(self, k)

  @functools.wraps(forward)  # transformers reads forward's signature for its kwargs.
  def counted_forward(*args, **kwargs):
    ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
    calls.append(int(ids.shape[1]))
    return forward(*args, **kwargs)

  cache_cls.clear_last_k_entries = clear_last_k_entries
  model.forward = counted_forward
  return clears, calls


def accepted_per_round(clears: list[int], lookahead: int) -> list[int]:
  """Tokens each round accepted, from the trims' k (module docstring)."""
  rounds: list[int] = []
  for k in clears:
    if k == lookahead:  # A round's first trim: its draft entries.
      rounds.append(lookahead)
    else:  # Its second: the verified entries after the first mismatch.
      rounds[-1] -= k
  return rounds


def speculative(torch, model, log, prompt: list[int], case: dict) -> tuple[list[int], list[int]]:
  """(tokens, accepted per round) of one generate_speculative run, checked for consistency."""
  from transformers import GenerationConfig

  clears, calls = log
  clears.clear()
  calls.clear()
  config = GenerationConfig(do_sample=False, return_dict_in_generate=True, pad_token_id=0)
  out = model.generate_speculative(
    torch.tensor([prompt]), config, max_new_tokens=NEW_TOKENS, init_scale=0.0, **case
  )
  tokens = out.sequences[0, len(prompt) :].tolist()
  k = case["lookahead_for_draft"]
  rounds = accepted_per_round(clears, k)
  want_calls = [len(prompt)] + ([1] * k + [k]) * len(rounds)  # Prefill; drafts, verify.
  assert calls == want_calls, (calls, want_calls)
  assert 1 + sum(rounds) == len(tokens) >= NEW_TOKENS, (rounds, tokens)
  return tokens, rounds


def greedy(torch, model, log, prompt: list[int], num_steps: int) -> list[int]:
  """Huginn's plain `generate` (transformers' greedy search over its forward) at num_steps."""
  from transformers import GenerationConfig

  clears, calls = log
  calls.clear()
  config = GenerationConfig(do_sample=False, return_dict_in_generate=True, pad_token_id=0)
  out = model.generate(
    torch.tensor([prompt]),
    config,
    max_new_tokens=GREEDY_TOKENS,
    num_steps=num_steps,
    init_scale=0.0,
  )
  tokens = out.sequences[0, len(prompt) :].tolist()
  assert len(tokens) == GREEDY_TOKENS and calls == [len(prompt)] + [1] * (GREEDY_TOKENS - 1)
  return tokens


def meta(torch) -> dict:
  import transformers

  return {
    "source": "seal-rg/recurrent-pretraining recpre/raven_modeling_minimal.py",
    "commit": "59e0b69b2d96a59cbbe79c9d5034d89ecb5ab6f6",
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "numpy": np.__version__,
    "batch": 1,
    "dtype": "float32",
    "do_sample": False,
    "init_scale": 0.0,
    "cache_lookup_strategy": "full",
    "verification_threshold": 1,
    "max_new_tokens": NEW_TOKENS,
    "overshoot": "generate_speculative stops after the round in which it reaches"
    " max_new_tokens; `tokens` keep every token it returned, so up to lookahead - 1 more",
    "accepted": "per round, from the cache trims (clear_last_k_entries) the method makes",
    "greedy": "per num_steps, per prompt: the first greedy_tokens tokens of the reference's"
    " plain generate (transformers' greedy search) at that depth",
    "greedy_tokens": GREEDY_TOKENS,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--huginn_modeling_file", required=True)
  parser.add_argument("--out", default=os.path.join(adaptive_refs.TINY, "speculative.json"))
  args = parser.parse_args()
  torch = refs.need("torch")
  refs.need("transformers")
  module = refs.load_reference(args.huginn_modeling_file, "huginn_reference")
  model = module.RavenForCausalLM.from_pretrained(adaptive_refs.TINY, dtype=torch.float32)
  model.eval()
  log = instrument(module, model)
  golden = np.load(os.path.join(adaptive_refs.TINY, "golden.npz"))
  prompts = [row[: adaptive_refs.PROMPT_TOKENS].tolist() for row in golden["input_ids"]]
  cases = {}
  for name, case in CASES.items():
    runs = [speculative(torch, model, log, p, case) for p in prompts]
    cases[name] = {
      "settings": case,
      "tokens": [t for t, _ in runs],
      "accepted": [a for _, a in runs],
    }
    print(name, [a for _, a in runs])
  steps = sorted({c["num_steps"] for c in CASES.values()})
  greedy_tokens = {str(n): [greedy(torch, model, log, p, n) for p in prompts] for n in steps}
  for name, case in cases.items():  # What speculation must equal, checked here too.
    for got, want in zip(case["tokens"], greedy_tokens[str(case["settings"]["num_steps"])]):
      print(name, "equals greedy:", got == want[: len(got)])
  with open(args.out, "w") as f:
    out = {"meta": meta(torch), "prompts": prompts, "cases": cases, "greedy": greedy_tokens}
    json.dump(out, f, indent=1)
    f.write("\n")
  print("wrote", args.out)


if __name__ == "__main__":
  main()
