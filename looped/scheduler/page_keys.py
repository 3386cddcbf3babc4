"""Page identities (prefix-cache keys) derived from a trace's block hashes, for any page size.

A trace such as Mooncake's describes each prompt by hash_ids of its consecutive 512-token blocks,
chained by prefix: equal ids at the same position mean equal prompts up to the end of that block
(traces.py checks the chain property). A page of `page_size` tokens covers tokens
[k * page_size, (k + 1) * page_size); the block holding its last token, j = ((k + 1) * page_size
- 1) // block_size, is the last block it touches. Two requests hold the same content in page k iff
they agree on every token up to the page's end, which the trace can only certify at block
granularity: iff they share block j (and with it, by chaining, every block before it). Hence

    key(k) = (hash_ids[j] << 32) | k,

a hash-chain key: it identifies the whole prefix through page k, so equal keys mean the page and
everything before it are equal, which is what prefix caching needs. This is exact when pages are
aligned with blocks and conservative otherwise: two prompts that diverge inside block j but agree
through the page's end share the page in reality, but the trace cannot tell. Partial last blocks
are handled the same way (an equal id means an equal partial block, hence equal length).

Only full prompt pages get shared keys. Pages that contain generated tokens get keys unique to
their request (the trace says nothing about output contents), so they can only be hit by the same
request after a preemption, as in vLLM where decoded blocks are hashed too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_POSITION_BITS = 32


def prompt_page_keys(
  block_hashes: Sequence[int], block_size: int, prompt_len: int, page_size: int
) -> list[int]:
  """Keys of the prompt's full pages (prompt_len // page_size of them), all >= 0."""
  num_pages = prompt_len // page_size
  if not num_pages:
    return []
  if max(block_hashes) >= 1 << (63 - _POSITION_BITS):  # Too wide for int64: plain Python.
    return [
      (block_hashes[((k + 1) * page_size - 1) // block_size] << _POSITION_BITS) | k
      for k in range(num_pages)
    ]
  k = np.arange(num_pages, dtype=np.int64)
  last_block = ((k + 1) * page_size - 1) // block_size
  hashes = np.asarray(block_hashes, dtype=np.int64)[last_block]
  return ((hashes << _POSITION_BITS) | k).tolist()


def private_page_key(request_id: int, page_index: int) -> int:
  """Key of a page that only its own request can hit (negative: never equals a prompt key)."""
  return -(((request_id << _POSITION_BITS) | page_index) + 1)
