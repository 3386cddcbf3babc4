"""Pallas kernels for looped LMs: shared-cache flash attention and paged decode attention.

Knows nothing of `looped` (looped imports it, never the reverse). Each kernel has a pure-JAX
reference in `pallas_kernels.reference`.
"""

from pallas_kernels.kv_formats import PackedKV
from pallas_kernels.paged_decode import paged_decode
from pallas_kernels.shared_attention import shared_attention

__all__ = ["PackedKV", "paged_decode", "shared_attention"]
