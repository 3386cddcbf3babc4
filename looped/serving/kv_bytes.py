"""Bytes per stored K or V value for each KV-cache format.

The formats are the ones of looped.kv_quant (DESIGN.md section 4). The serving code only needs
their storage cost, so it keeps a local copy of the formula; tests pin it against
looped.kv_quant.bytes_per_value.
"""

# Element bytes and scale overhead: (bytes per element, scale bytes, values per scale).
# 'per_head' means one scale per head vector (head_dim values).
_FORMATS = {
  "bf16": (2.0, 0, 1),
  "fp8": (1.0, 4, "per_head"),  # e4m3 elements, one fp32 scale per head vector.
  "mxfp8": (1.0, 1, 32),  # OCP MX: e4m3 elements, one e8m0 scale per 32 values.
  "mxfp8_rceil": (1.0, 1, 32),  # Same storage as mxfp8; only the scale rounding differs.
  "nvfp4": (0.5, 1, 16),  # e2m1 elements, one e4m3 scale per 16 (+ a per-tensor fp32).
}

FORMATS = tuple(_FORMATS)


def bytes_per_value(fmt: str, head_dim: int) -> float:
  """Average bytes one K or V element takes in the cache, scales included."""
  if fmt not in _FORMATS:
    raise ValueError(f"Unknown KV format {fmt!r}; allowed: {', '.join(FORMATS)}.")
  element, scale_bytes, group = _FORMATS[fmt]
  if not scale_bytes:
    return element
  if group == "per_head":
    return element + scale_bytes / head_dim
  if head_dim % group:
    raise ValueError(
      f"KV format {fmt!r} needs head_dim to be a multiple of {group}, got {head_dim}."
    )
  return element + scale_bytes / group
