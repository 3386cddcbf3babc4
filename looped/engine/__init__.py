"""Generation engine (docs/design.md §5): the real model behind the serving scheduler."""
