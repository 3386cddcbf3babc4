"""BeNice! post-training, its baselines and the KV-shareability evaluation (docs/design.md §3-4).

objectives.py  the BeNice! loss           evaluation.py  shareability metrics of one model
stages.py      per-stage configs/markers  pipeline.py    the `benice` program (all stages)
report.py      JSON + Markdown table      plots.py       PNG plots
collect.py     one table over many runs (seeds, arms, ablations)
"""
