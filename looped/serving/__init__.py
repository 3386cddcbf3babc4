"""Serving: a paged KV pool with prefix caching, a continuous-batching scheduler, and a
trace-driven simulator that drives the scheduler with a roofline cost model (docs/design.md §5).

Everything here needs only a model's shape, never its weights, so the inference engine can reuse
the pool and the scheduler with an executor that runs the real model.
"""
