"""KV bytes per value: looped.kv_quant's figures, pinned to the formats' storage formulas.

The serving simulator sizes pages and prices KV traffic with looped.kv_quant.bytes_per_value; these
are the formulas it must follow (element bytes plus scale overhead), written out independently.
"""

from absl.testing import absltest

from configs import serve_sim
from looped import kv_quant
from looped.sim import shape


def _reference(fmt: str, head_dim: int) -> float:
  return {
    "bf16": 2.0,
    "fp8": 1.0 + 4.0 / head_dim,  # e4m3 byte + one fp32 scale per head vector.
    "mxfp8": 1.0 + 1.0 / 32,  # e4m3 byte + one e8m0 byte per 32 values.
    "mxfp8_rceil": 1.0 + 1.0 / 32,
    "nvfp4": 0.5 + 1.0 / 16,  # e2m1 nibble + one e4m3 byte per 16 values.
  }[fmt]


class KvBytesTest(absltest.TestCase):
  def test_kv_quant_matches_the_formulas(self):
    self.assertEqual(kv_quant.FORMATS, ("bf16", "fp8", "mxfp8", "mxfp8_rceil", "nvfp4"))
    for fmt in kv_quant.FORMATS:
      for head_dim in (32, 64, 128, 256):
        with self.subTest(fmt=fmt, head_dim=head_dim):
          self.assertEqual(kv_quant.bytes_per_value(fmt, head_dim), _reference(fmt, head_dim))

  def test_model_shape_uses_them(self):
    s = shape.ModelShape.from_config(serve_sim.get_config().model)
    for fmt in kv_quant.FORMATS:
      with self.subTest(fmt=fmt):
        self.assertEqual(s.kv_bytes_per_token_layer(fmt), 4 * 128 * 2 * _reference(fmt, 128))

  def test_block_formats_reject_head_dims_off_the_block(self):
    with self.assertRaisesRegex(ValueError, "multiple of its block size 16"):
      kv_quant.bytes_per_value("nvfp4", 24)


if __name__ == "__main__":
  absltest.main()
