"""Config sections declared once (looped.schema): a field added to a schema appears in the
config's defaults, its validation and its help; every config follows its sections' schemas."""

import dataclasses
import importlib
from unittest import mock

import ml_collections
from absl.testing import absltest, parameterized

import configs
from configs import pretrain
from looped import cli, config_checks, schema
from looped.model import config as model_config
from looped.schema import field
from looped.train import trainer


@dataclasses.dataclass(frozen=True)
class Widget:
  count: int = field(3, "Widgets per box.", min=1, max=8)
  ratio: float = field(0.5, "Share kept.", gt=0.0, lt=1.0)
  kind: str = field("round", "Their shape.", choices=("round", "square"))
  name: str = field("w", "A label.", nonempty=True)
  loud: bool = field(False, "Whether they beep.")
  parts: tuple[str, ...] = field(("a",), "Parts, in order.", items=("a", "b"), noun="parts")
  budget: float | None = field(None, "Bytes (None: any).", gt=0.0)


def _widget_config(**values) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict({"widget": schema.defaults(Widget)})
  for key, value in values.items():
    with c.widget.ignore_type():
      c.widget[key] = value
  return c


def _error(config, prefix="widget", section=Widget) -> str:
  with absltest.TestCase().assertRaises(config_checks.ConfigError) as e:
    schema.validate(section, config, prefix)
  return str(e.exception)


@dataclasses.dataclass(frozen=True)
class ModelWithExtra(model_config.ModelConfig):
  """The model section with one more field and one changed default."""

  d_model: int = field(256, "Residual stream width.", min=1)
  num_gates: int = field(2, "Gates per layer.", min=1, max=4)


def _config_modules():
  for name in ("pretrain", "benice", "generate", "serve", "serve_sim", "convert", "export"):
    module = importlib.import_module(f"configs.{name}")
    for variant in ("", *getattr(module, "VARIANTS", {})):
      config = module.get_config(variant) if variant else module.get_config()
      yield f"{name}:{variant}", config


class SchemaTest(parameterized.TestCase):
  def test_defaults_are_the_declared_values(self):
    c = schema.defaults(Widget)
    self.assertEqual(c.to_dict(), dataclasses.asdict(Widget()))
    self.assertEqual(schema.defaults(Widget, only=("kind",)).to_dict(), {"kind": "round"})
    with self.assertRaisesRegex(TypeError, "no field"):
      schema.defaults(Widget, only=("color",))
    schema.validate(Widget, _widget_config(), "widget")

  @parameterized.parameters(
    ("count", 0, "config.widget.count = 0 is invalid: must be >= 1."),
    ("count", 9, "config.widget.count = 9 is invalid: must be <= 8."),
    ("count", 2.5, "config.widget.count = 2.5 is invalid: must be an integer."),
    ("ratio", 1.0, "config.widget.ratio = 1.0 is invalid: must be < 1.0."),
    ("ratio", 0.0, "config.widget.ratio = 0.0 is invalid: must be > 0.0."),
    ("kind", "oval", "config.widget.kind = 'oval' is invalid: must be one of 'round', 'square'."),
    ("name", "", "config.widget.name = '' is invalid: must be a non-empty string."),
    ("loud", "yes", "config.widget.loud = 'yes' is invalid: must be True or False."),
    (
      "parts",
      "a",
      "config.widget.parts = 'a' is invalid: must be a tuple of parts from ('a', 'b').",
    ),
    ("parts", ("a", "c"), "unknown parts ['c']; allowed: ('a', 'b')."),
    ("budget", -1.0, "config.widget.budget = -1.0 is invalid: must be > 0.0."),
  )
  def test_bad_value_names_field_and_range(self, name, value, message):
    self.assertIn(message, _error(_widget_config(**{name: value})))

  def test_optional_accepts_none_and_numbers(self):
    schema.validate(Widget, _widget_config(budget=None), "widget")
    schema.validate(Widget, _widget_config(budget=4e6), "widget")

  def test_unknown_and_missing_fields(self):
    c = _widget_config()
    c.widget.cuont = 3
    with self.assertRaises(config_checks.ConfigError) as e:
      schema.validate(Widget, c, "widget")
    self.assertIn(
      "config.widget has unknown field(s) ['cuont'] (did you mean 'count'?)", str(e.exception)
    )
    self.assertEqual(e.exception.suggestion, "count")
    c = _widget_config()
    del c.widget["loud"]
    self.assertIn("config.widget.loud is missing", _error(c))

  @parameterized.parameters(
    ("count", "Widgets per box. [integer >= 1, <= 8]"),
    ("ratio", "Share kept. [number > 0.0, < 1.0]"),
    ("kind", "Their shape. [one of 'round', 'square']"),
    ("name", "A label. [non-empty string]"),
    ("loud", "Whether they beep. [True or False]"),
    ("parts", "Parts, in order. [tuple of parts from 'a', 'b']"),
    ("budget", "Bytes (None: any). [number > 0.0, or None]"),
  )
  def test_help_shows_doc_and_range(self, name, expected):
    self.assertEqual(schema.describe(Widget, name), expected)
    self.assertIsNone(schema.describe(Widget, "color"))

  def test_a_field_without_doc_is_refused(self):
    @dataclasses.dataclass(frozen=True)
    class Bare:
      size: int = 3

    with self.assertRaisesRegex(TypeError, "Bare.size is not a schema.field"):
      schema.defaults(Bare)
    with self.assertRaisesRegex(TypeError, "not both"):
      field(1.0, "x", min=0.0, gt=0.0)


class ModelSchemaTest(parameterized.TestCase):
  """The model section: one definition (ModelConfig) behind the config, validation and help."""

  def test_config_defaults_are_the_dataclass_defaults(self):
    self.assertEqual(model_config.from_config(pretrain.model_config()), model_config.ModelConfig())

  def test_a_field_added_once_reaches_defaults_validation_and_help(self):
    with (
      mock.patch.object(model_config, "ModelConfig", ModelWithExtra),
      mock.patch.object(pretrain, "ModelConfig", ModelWithExtra),
      mock.patch.dict(configs.SECTIONS, {"model": ModelWithExtra}),
    ):
      config = pretrain.get_config("")
      self.assertEqual(config.model.num_gates, 2)  # Defaults.
      self.assertEqual(config.model.d_model, 256)  # A changed default changes the config.
      trainer.validate(config)
      config.model.num_gates = 5
      with self.assertRaises(config_checks.ConfigError) as e:
        trainer.validate(config)
      self.assertEqual(
        str(e.exception), "config.model.num_gates = 5 is invalid: must be <= 4."
      )  # Validation names the field and its range.
      help_text = cli.config_help("configs/pretrain.py")  # Loads the file afresh.
      self.assertIn(
        "config.model.num_gates = 2  # Gates per layer. [integer >= 1, <= 4]", help_text
      )
      self.assertIn(
        "config.model.d_model = 256  # Residual stream width. [integer >= 1]", help_text
      )
    self.assertEqual(pretrain.get_config("").model.d_model, 128)
    self.assertNotIn("num_gates", pretrain.get_config("").model)

  def test_help_prints_the_schema_doc_and_range(self):
    help_text = cli.config_help("configs/pretrain.py:smoke")
    self.assertIn("config.model.d_model = 64  # Residual stream width. [integer >= 1]", help_text)
    self.assertIn(
      "config.model.diagonal_decay_init = 0.5  # injection='diagonal': per-channel decay of h "
      "at init. [number > 0.0, < 1.0]",
      help_text,
    )
    self.assertIn("config.train.num_steps = 60  # Optimizer steps. [integer >= 1]", help_text)
    self.assertIn("config.seed = 0  # Seed for parameters", help_text)  # Outside the sections.


class SectionsTest(parameterized.TestCase):
  """Every config's sections follow their schemas (configs.SECTIONS)."""

  def test_every_config_section_follows_its_schema(self):
    seen = set()
    for name, config in _config_modules():
      for path, section in configs.SECTIONS.items():
        try:
          node = config_checks.get(config, path)
        except config_checks.ConfigError:
          continue
        seen.add(path)
        with self.subTest(config=name, section=path):
          schema.check_unknown(section, node, path)
          fields = schema.fields(section)
          for key in node.keys():  # A section may hold a subset (post.train, generate's data).
            kind, _, rule = fields[key]
            if rule.nonempty and node[key] == "":
              continue  # A field the command line must set (a checkpoint, a source folder).
            schema.check_field(config, f"{path}.{key}", kind, rule)
    self.assertEqual(seen, set(configs.SECTIONS))

  def test_every_field_has_a_doc_and_every_number_a_range(self):
    for path, section in configs.SECTIONS.items():
      for name, (kind, _, rule) in schema.fields(section).items():
        with self.subTest(field=f"{path}.{name}"):
          self.assertRegex(rule.doc, r"^\S.*\.$")  # One sentence (or more), ending in a period.
          self.assertNotIn("\n", rule.doc)
          if kind in (int, float) and not rule.by_hand and rule.choices is None:
            bounds = (rule.min, rule.max, rule.gt, rule.lt)
            self.assertTrue(any(b is not None for b in bounds), "a number without a range")

  def test_schema_sections_are_the_validators_sections(self):
    # Each section's range checks come from its schema: a bad value of every bounded field
    # fails naming the field and its bound.
    config = pretrain.get_config("smoke")
    for name, (kind, _, rule) in schema.fields(model_config.ModelConfig).items():
      if kind is int and rule.min is not None:
        bad = pretrain.get_config("smoke")
        bad.model[name] = int(rule.min) - 1
        with self.subTest(field=name), self.assertRaises(config_checks.ConfigError) as e:
          trainer.validate(bad)
        self.assertIn(f"config.model.{name} = {int(rule.min) - 1} is invalid", str(e.exception))
        self.assertIn(f">= {rule.min}", str(e.exception))
    trainer.validate(config)


if __name__ == "__main__":
  absltest.main()
