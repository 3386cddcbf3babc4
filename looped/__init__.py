"""looped: looped (weight-shared, recurrent-depth) LMs with KV-caches shared across recurrences."""

__version__ = "0.1.0"
