"""Outside CI: a looped checkpoint (e.g. the README main command's BeNice! model, WORKDIR/benice)
exported with export.family=auto runs in a Python that has torch and transformers but not looped
(a fresh virtualenv) with looped's logits and looped's greedy generations.

The export program writes the folder; the torch Python loads it with
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` (float32; no missing or
unexpected weight) and its tokenizer with AutoTokenizer, and computes (1) the logits of fixed
token rows in one forward, at the recorded R and at R = 2, and (2) greedy `generate()` of each
prompt, shared (config.json's default: share_kv, 'final', prompt blocks of 32) and unshared,
one prompt at a time and all prompts in one left-padded batch. looped computes (1) with LoopedLM
and (2) with the generation program (configs/generate.py, greedy, max_new_tokens, EOS stops).
Prints the largest |difference| of the logits and its ratio to the largest |logit|, the tokens
equal per prompt, and the tokenizer's ids against looped's; exits 1 unless the ratio is <= 1e-5
and every generation and id list is equal.

  python tests/check_hf_looped_export.py --checkpoint=/tmp/benice/benice \
      --torch_python=/tmp/hfvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

_TOLERANCE = 1e-5
_PROMPTS = (
  "def main(",
  "The quick brown fox",
  "import numpy as np\n\n\ndef f(x):\n    return",
  "class Node:\n    def __init__(self, value):\n        self.value = value\n        self.next =",
)


def torch_side(folder: str, inputs: str, out: str) -> None:
  """In the torch Python: the folder's logits, tokenization and greedy generations."""
  import torch
  import transformers

  data = np.load(inputs)
  prompts = json.loads(str(data["prompts"]))
  max_new = int(data["max_new_tokens"])
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
    folder, trust_remote_code=True, dtype=torch.float32, output_loading_info=True
  )
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  model.eval()
  tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
  result = {"torch": torch.__version__, "transformers": transformers.__version__}
  ids = torch.tensor(data["rows"]).long()
  with torch.no_grad():
    result["logits"] = model(ids).logits.numpy().tolist()
    result["logits_r2"] = model(ids, num_recurrences=2).logits.numpy().tolist()
  result["prompt_ids"] = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
  for share in (True, False):
    one = []
    for p in result["prompt_ids"]:
      with torch.no_grad():
        out_ids = model.generate(
          torch.tensor([p]), max_new_tokens=max_new, do_sample=False, share_kv=share
        )
      one.append(out_ids[0, len(p) :].tolist())
    result[f"one_share{share}"] = one
    tok.padding_side = "left"
    batch = tok(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
      out_ids = model.generate(**batch, max_new_tokens=max_new, do_sample=False, share_kv=share)
    width = batch["input_ids"].shape[1]
    result[f"batch_share{share}"] = [row[width:].tolist() for row in out_ids]
  with open(out, "w") as f:
    json.dump(result, f)


def _until_eos(tokens, eos: int) -> list[int]:
  """The tokens up to the first EOS (included: both generate() and the engine emit it)."""
  tokens = list(tokens)
  return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def looped_side(args) -> int:
  import dataclasses

  import jax
  import jax.numpy as jnp
  import ml_collections

  from configs import export as export_config
  from configs import generate as generate_config
  from looped import programs
  from looped.checkpoints import model_record, restore
  from looped.data import tokenizers
  from looped.model import LoopedLM
  from looped.model import config as model_lib

  tmp = args.workdir or tempfile.mkdtemp()
  folder = os.path.join(tmp, "exported")
  config = export_config.get_config()
  config.export.checkpoint = args.checkpoint
  config.export.family = "auto"
  written = programs.run(config, folder)
  print(f"export family=auto wrote {written['family']}: {', '.join(sorted(written['files']))}")
  record = model_record.read(args.checkpoint)
  fields = {
    f: model_record.recorded_value(record, f) for f in model_lib.ModelConfig.__dataclass_fields__
  }
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
  cfg = model_lib.from_config(ml_collections.ConfigDict(fields))
  tok = tokenizers.get(ml_collections.ConfigDict(record["data"]))
  text = "".join(_PROMPTS) * 8
  row = [int(t) for t in tok.encode(text)][: min(128, cfg.max_seq_len)]
  rows = np.asarray([row, row[::-1]], np.int32)
  params = restore.restore_params(LoopedLM(cfg), args.checkpoint, -1, "checkpoint")
  logits = {
    "logits": LoopedLM(cfg).apply(params, jnp.asarray(rows))[0],
    "logits_r2": LoopedLM(dataclasses.replace(cfg, num_recurrences=2)).apply(
      params, jnp.asarray(rows)
    )[0],
  }
  generations = {}
  prompts = os.path.join(tmp, "prompts.jsonl")
  with open(prompts, "w") as f:
    f.writelines(json.dumps({"prompt": p}) + "\n" for p in _PROMPTS)
  for share in (True, False):
    gen = generate_config.get_config()
    gen.gen.checkpoint = args.checkpoint
    gen.gen.prompts = prompts
    gen.gen.max_new_tokens = args.max_new_tokens
    gen.gen.share_kv = share
    gen.gen.stream = False
    out = programs.run(gen, os.path.join(tmp, f"generate_share{share}"))
    generations[share] = [list(g.tokens) for g in out["generations"]]
  inputs, out = os.path.join(tmp, "inputs.npz"), os.path.join(tmp, "torch.json")
  np.savez(
    inputs, rows=rows, prompts=np.array(json.dumps(_PROMPTS)), max_new_tokens=args.max_new_tokens
  )
  here = os.path.abspath(__file__)
  subprocess.run([args.torch_python, here, "--torch_side", folder, inputs, out], check=True)
  with open(out) as f:
    theirs = json.load(f)
  ok = True
  for key, mine in logits.items():
    mine = np.asarray(mine, np.float64)
    diff = float(np.abs(np.asarray(theirs[key]) - mine).max())
    ratio = diff / float(np.abs(mine).max())
    ok &= ratio <= _TOLERANCE
    print(
      f"{key}: max |transformers - looped| = {diff:.2e} (max |logit| {np.abs(mine).max():.2f}, "
      f"ratio {ratio:.1e})"
    )
  ids_equal = theirs["prompt_ids"] == [[int(t) for t in tok.encode(p)] for p in _PROMPTS]
  ok &= ids_equal
  print(f"tokenizer ids equal looped's: {ids_equal}")
  eos = tok.eos_id
  for share in (True, False):
    want = [_until_eos(g, eos) for g in generations[share]]
    for mode in ("one", "batch"):
      got = [_until_eos(g, eos) for g in theirs[f"{mode}_share{share}"]]
      equal = sum(a == b for a, b in zip(got, want))
      tokens = sum(len(w) for w in want)
      same = sum(x == y for a, b in zip(got, want) for x, y in zip(a, b))
      ok &= equal == len(want)
      print(
        f"generate() share_kv={share} ({mode}): {equal}/{len(want)} generations equal the "
        f"generation program's, {same}/{tokens} tokens"
      )
  print(f"jax {jax.__version__}; torch {theirs['torch']}, transformers {theirs['transformers']}")
  return 0 if ok else 1


def main() -> int:
  if len(sys.argv) > 1 and sys.argv[1] == "--torch_side":
    torch_side(*sys.argv[2:5])
    return 0
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--checkpoint", required=True, help="a trainer workdir or pipeline stage dir")
  p.add_argument("--torch_python", required=True, help="a Python with torch and transformers")
  p.add_argument("--max_new_tokens", type=int, default=48)
  p.add_argument("--workdir", default="", help="where to write (default: a new temp dir)")
  return looped_side(p.parse_args())


if __name__ == "__main__":
  sys.exit(main())
