"""The throughput a training step is measured against: float32 n x n x n matmuls, one per device
at once, in the benchmarks' own process. The measurement lives in the package
(looped/train/mfu.py), where the trainer uses it as the CPU's peak for MFU."""

from looped.train.mfu import MatmulLimit

__all__ = ["MatmulLimit"]
