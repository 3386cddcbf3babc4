"""Data: document sources, tokenizers, packing into rows, Grain iterators (docs/design.md §8).

The trainer uses only these names; row layout and split rules are documented in packing.py and
sources.py.
"""

from looped.data.checks import tokenizer_vocab_size, validate
from looped.data.pipeline import eval_bytes_per_token, make_eval_batches, make_train_iterator

__all__ = [
  "eval_bytes_per_token",
  "make_eval_batches",
  "make_train_iterator",
  "tokenizer_vocab_size",
  "validate",
]
