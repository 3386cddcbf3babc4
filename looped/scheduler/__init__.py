"""Continuous batching over a paged, prefix-cached KV pool (docs/design.md §5).

Needs only a model's shape, never its weights: the engine (looped/engine) drives it with an
executor that runs the model, the simulator (looped/sim) with one that prices each step.
"""
