"""ml_collections configs: one `get_config(arg)` per file; `VARIANTS` lists its args."""


def parse_args(arg: str, variants: dict[str, str]) -> set[str]:
  """The set of variants in `arg` ('smoke,fixed'); ValueError naming the allowed ones."""
  args = {a for a in arg.split(",") if a}
  unknown = args - set(variants)
  if unknown:
    allowed = ", ".join(f"'{v}'" for v in variants)
    raise ValueError(f"unknown config variant(s) {sorted(unknown)}; allowed: {allowed}.")
  return args
