"""The serving simulator: request traces replayed through the scheduler under KV budgets, each
step priced by a roofline cost model instead of run (docs/serving_sim.md)."""
