"""Moved: the scheduler and page pool are looped.scheduler, the simulator looped.sim, the padded
step shape looped.engine.padding."""

raise ImportError(
  "looped.serving was split: import the scheduler, page pool and prefix cache from "
  "looped.scheduler, the serving simulator from looped.sim, and padding from looped.engine.padding."
)
