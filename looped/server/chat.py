"""Chat templates: the served model's own (its tokenizer's), rendered as transformers renders it,
or DEFAULT_TEMPLATE for a model that has none (the project's byte-level models).

A converted checkpoint keeps its source's `tokenizer_config.json` beside `tokenizer.json`
(looped/convert); its `chat_template` (or a `chat_template.jinja` file beside it, which newer
transformers write instead) is a Jinja template of the messages. It is rendered with jinja2 in
the environment transformers' `apply_chat_template` uses, so a template written for the model
gives the prompt the model was tuned on: a sandbox; `trim_blocks` and `lstrip_blocks`; the
`loopcontrols` extension; `raise_exception(message)`, `strftime_now(format)` and a `tojson`
that keeps non-ASCII text as it is; the `{% generation %}` tag (rendered as its body); and as
variables `messages` (their null keys dropped), `tools` and `documents` (null),
`add_generation_prompt` and the tokenizer's special tokens by name (`bos_token`, `eos_token`,
...). tests/server_chat_test.py compares the renders with transformers'.
"""

from __future__ import annotations

import datetime
import json
import logging
import os

import jinja2
from jinja2 import ext, nodes, sandbox

log = logging.getLogger(__name__)

# For a model whose tokenizer has no chat template: a plain transcript, one paragraph per
# message under its role's name, ending with the assistant's name for the reply to follow. The
# byte-level models here are pretrained on text, not on chats: this is a prompt they can continue.
DEFAULT_TEMPLATE = (
  "{% for message in messages %}"
  "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
  "{% endfor %}"
  "{% if add_generation_prompt %}Assistant:{% endif %}"
)

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
TEMPLATE_FILE = "chat_template.jinja"
# The special tokens a template sees by name (transformers' named special tokens).
SPECIAL_TOKENS = (
  "bos_token",
  "eos_token",
  "unk_token",
  "sep_token",
  "pad_token",
  "cls_token",
  "mask_token",
)


class _Generation(ext.Extension):
  """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's text with it
  (for training masks); rendering, it is its body."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller) -> str:
    return caller()


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
  return datetime.datetime.now().strftime(format)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  # jinja2's own tojson escapes HTML characters (<, >, &, '), which a prompt must keep.
  return json.dumps(
    value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def environment() -> sandbox.ImmutableSandboxedEnvironment:
  """The Jinja environment chat templates are written for (transformers')."""
  env = sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols, _Generation]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env


class ChatTemplate:
  """A compiled chat template and the variables it renders with (the special tokens).

  origin: where the template came from (a file, or 'default'), for the log and errors."""

  def __init__(self, source: str, origin: str, special_tokens: dict[str, str] | None = None):
    self.source = source
    self.origin = origin
    self.special_tokens = dict(special_tokens or {})
    try:
      self._template = environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
      raise ValueError(f"the chat template of {origin} is not valid Jinja: {e}") from None

  def render(self, messages, add_generation_prompt: bool = True) -> str:
    """The prompt of `messages` (dicts of role, content, ...); raises what the template raises
    (jinja2.TemplateError for its own refusals)."""
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return self._template.render(
      **self.special_tokens,
      messages=chat,
      tools=None,
      documents=None,
      add_generation_prompt=add_generation_prompt,
    )


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, ValueError):
    return {}
  return value if isinstance(value, dict) else {}


def _token_text(value) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or {'content': ...}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def from_folder(folder: str) -> ChatTemplate | None:
  """The chat template of a Hugging Face tokenizer folder (chat_template.jinja, else
  tokenizer_config.json's `chat_template`: a string, or a list of named templates of which the
  one named 'default' is used), with its special tokens; None if it has none."""
  config = _read_json(os.path.join(folder, TOKENIZER_CONFIG))
  special = _read_json(os.path.join(folder, SPECIAL_TOKENS_MAP))
  tokens = {}
  for name in SPECIAL_TOKENS:
    text = _token_text(config.get(name)) or _token_text(special.get(name))
    if text is not None:
      tokens[name] = text
  path = os.path.join(folder, TEMPLATE_FILE)
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return ChatTemplate(f.read(), path, tokens)
  source = config.get("chat_template")
  if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
    named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
    source = named.get("default")
  if not isinstance(source, str) or not source:
    return None
  return ChatTemplate(source, os.path.join(folder, TOKENIZER_CONFIG), tokens)


def for_tokenizer(tokenizer) -> ChatTemplate:
  """The served model's template: its Hugging Face tokenizer folder's, else DEFAULT_TEMPLATE."""
  path = getattr(tokenizer, "path", None)
  if isinstance(path, str) and path.endswith(".json"):  # A tokenizer.json (HuggingFaceTokenizer).
    template = from_folder(os.path.dirname(os.path.abspath(path)))
    if template is not None:
      log.info("chat template: %s", template.origin)
      return template
  log.info("chat template: the default transcript (the tokenizer has none)")
  return ChatTemplate(DEFAULT_TEMPLATE, "default")
