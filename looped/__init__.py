"""looped: looped (weight-shared, recurrent-depth) LMs whose KV-cache is shared across recurrences."""

__version__ = "0.1.0"
