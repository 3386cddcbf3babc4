"""Chat templates and `/v1/chat/completions` on a converted checkpoint.

- The converted Huginn and Ouro test checkpoints (tests/testdata/*_tiny carry a template in each
  family's chat format; the converter keeps it) render a chat as transformers'
  `apply_chat_template` renders it, and the prompt's tokens are transformers' (its special
  tokens whole); so do templates that use the rest of the Jinja environment templates are
  written for (whitespace control, loop controls, namespaces, `tojson` of non-ASCII and HTML
  characters, `strftime_now`, the `{% generation %}` tag, a template's own `raise_exception`,
  a `chat_template.jinja` file, a list of named templates).
- A converted Ouro served over HTTP: a chat's reply, usage and logprobs are those of
  `/v1/completions` on transformers' token ids for it; streamed deltas concatenate to the
  reply; the openai client reads both.
- A model without a template (the bytes tokenizer) gets chat.DEFAULT_TEMPLATE.
"""

import json
import os
import shutil
import tempfile

import openai
from absl.testing import absltest

from configs import convert as convert_config
from configs import serve as serve_config
from looped import programs
from looped.data import tokenizers
from looped.server import chat, client, program, protocol
from server_harness import ServerThread

try:
  import transformers
except ImportError:  # The hf extra: without it only the renders' comparisons are skipped.
  transformers = None

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")
_FAMILIES = ("huginn", "ouro")
_TIMEOUT_S = 240
_CHATS = (
  [{"role": "user", "content": "def main("}],
  [
    {"role": "system", "content": "Be brief. "},
    {"role": "user", "content": "  héllo <b>&</b> 'x'\n"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "2+2?", "name": "ann"},
  ],
)
# Templates for the rest of the environment: each renders every chat of _CHATS.
_ENVIRONMENT_TEMPLATES = {
  "whitespace, loops, namespace, tojson, generation": """
{%- set ns = namespace(users=0) -%}
{% for message in messages %}
  {% if message.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
  {% if message.role == 'assistant' %}
    {% generation %}[{{ message.content }}]{% endgeneration %}
    {% continue %}
  {% endif %}
  {{ message.role }}: {{ message | tojson }} {{ message.content | tojson(indent=2) }}
  {% if loop.index > 3 %}{% break %}{% endif %}
{% endfor %}
users={{ ns.users }} tools={{ tools is none }} documents={{ documents is none }}
bos={{ bos_token }} eos={{ eos_token }} pad={{ pad_token }} unk={{ unk_token is defined }}
{% if add_generation_prompt %}assistant:{% endif %}
""",
  "strftime_now, dict": (
    "{{ strftime_now('%Y') }}{% set d = dict(a=1) %}{{ d.a }}"
    "{% for m in messages %}{{ m['content'] | trim }}|{% endfor %}"
  ),
}
# A multi-turn chat that fits the tiny Ouro's 64-token context with its template.
_SHORT_CHAT = [
  {"role": "system", "content": "s"},
  {"role": "user", "content": "hi"},
  {"role": "assistant", "content": "yo"},
  {"role": "user", "content": "ok"},
]
_RAISING_TEMPLATE = (
  "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
  "{{ raise_exception('a system message comes first') }}{% endif %}{{ m.content }}{% endfor %}"
)


def _convert(family: str, out: str) -> str:
  config = convert_config.get_config()
  config.convert.source = os.path.join(_DATA, f"{family}_tiny")
  programs.run(config, out)
  return out


def _folder(root: str, name: str, tokenizer_config: dict, template_file: str = "") -> str:
  """A tokenizer folder: ouro_tiny's tokenizer.json, this tokenizer_config.json and, if given,
  a chat_template.jinja."""
  folder = os.path.join(root, name)
  os.makedirs(folder)
  shutil.copyfile(
    os.path.join(_DATA, "ouro_tiny", "tokenizer.json"), os.path.join(folder, "tokenizer.json")
  )
  with open(os.path.join(folder, chat.TOKENIZER_CONFIG), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}, f)
  if template_file:
    with open(os.path.join(folder, chat.TEMPLATE_FILE), "w") as f:
      f.write(template_file)
  return folder


def _parsed(messages) -> tuple[dict, ...]:
  """The messages as the server's parser hands them to the template."""
  limits = protocol.Limits("m", 4096, 300, 5, 4096, 16)
  return protocol.Messages(name="messages", doc="").check(messages, limits, None)


@absltest.skipIf(transformers is None, "transformers is not installed (pip install -e '.[hf]')")
class RenderTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._tmp = tempfile.TemporaryDirectory()
    cls.converted = {f: _convert(f, os.path.join(cls._tmp.name, f)) for f in _FAMILIES}

  @classmethod
  def tearDownClass(cls):
    cls._tmp.cleanup()
    super().tearDownClass()

  def _assert_renders_as_transformers(self, folder: str, template=None):
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    template = template or chat.from_folder(folder)
    for messages in _CHATS:
      for generation_prompt in (True, False):
        want = hf.apply_chat_template(
          messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        got = template.render(_parsed(messages), add_generation_prompt=generation_prompt)
        self.assertEqual(got, want, (folder, messages, generation_prompt))
    return hf

  def test_converted_checkpoints_render_as_transformers(self):
    for family, converted in self.converted.items():
      source = os.path.join(_DATA, f"{family}_tiny")
      with open(os.path.join(source, chat.TOKENIZER_CONFIG)) as f:
        self.assertIn("chat_template", json.load(f), family)
      # What the server loads: the converted checkpoint's tokenizer and its folder's template.
      tokenizer = tokenizers.HuggingFaceTokenizer(os.path.join(converted, "tokenizer.json"))
      template = chat.for_tokenizer(tokenizer)
      self.assertNotEqual(template.origin, "default", family)
      hf = self._assert_renders_as_transformers(converted, template)
      for messages in _CHATS:
        want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        got = tokenizer.encode(template.render(_parsed(messages)))
        self.assertEqual([int(t) for t in got], list(want["input_ids"]), family)
    # Ouro's chat tokens are special tokens of its tokenizer: each is one id in the prompt.
    tokenizer = tokenizers.HuggingFaceTokenizer(
      os.path.join(self.converted["ouro"], "tokenizer.json")
    )
    ids = [int(t) for t in tokenizer.encode(chat.for_tokenizer(tokenizer).render(_CHATS[0]))]
    im_start = tokenizer.tokenizer.token_to_id("<|im_start|>")
    self.assertEqual(ids.count(im_start), 3)  # system, user, assistant

  def test_the_environment_renders_as_transformers(self):
    specials = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|x|>"}
    for i, (what, source) in enumerate(_ENVIRONMENT_TEMPLATES.items()):
      folder = _folder(self._tmp.name, f"env{i}", {**specials, "chat_template": source})
      self._assert_renders_as_transformers(folder)
      self.assertNotEqual(chat.from_folder(folder).render(_CHATS[1]), "", what)
    # A chat_template.jinja wins over tokenizer_config.json's; a list's 'default' is used.
    source = _ENVIRONMENT_TEMPLATES["strftime_now, dict"]
    folder = _folder(self._tmp.name, "file", {"chat_template": "ignored"}, source)
    self._assert_renders_as_transformers(folder)
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": source}]
    folder = _folder(self._tmp.name, "named", {"chat_template": named})
    self._assert_renders_as_transformers(folder)

  def test_a_templates_own_refusal_is_a_400_naming_the_messages(self):
    folder = _folder(self._tmp.name, "raising", {"chat_template": _RAISING_TEMPLATE})
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    late_system = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with self.assertRaisesRegex(Exception, "a system message comes first"):
      hf.apply_chat_template(late_system, tokenize=False)
    template = chat.from_folder(folder)
    tokenizer = tokenizers.HuggingFaceTokenizer(os.path.join(folder, "tokenizer.json"))
    limits = protocol.Limits("m", 64, 300, 5, 64, 16)
    raw = json.dumps({"messages": late_system}).encode()
    with self.assertRaises(protocol.RequestError) as e:
      protocol.parse_chat(raw, tokenizer, limits, template.render)
    self.assertEqual((e.exception.status, e.exception.param), (400, "messages"))
    self.assertIn("a system message comes first", str(e.exception))


class DefaultTemplateTest(absltest.TestCase):
  def test_a_tokenizer_without_a_template_gets_the_default(self):
    template = chat.for_tokenizer(tokenizers.BytesTokenizer())
    self.assertEqual(template.origin, "default")
    self.assertEqual(template.source, chat.DEFAULT_TEMPLATE)
    # The documented transcript (docs/server.md): a paragraph per message, then the reply's name.
    self.assertEqual(
      template.render(_parsed(_CHATS[1])),
      "System: Be brief. \n\nUser:   héllo <b>&</b> 'x'\n\n\nAssistant: Hi.\n\nUser: 2+2?\n\n"
      "Assistant:",
    )
    with tempfile.TemporaryDirectory() as tmp:  # A Hugging Face tokenizer with no template.
      folder = _folder(tmp, "plain", {"eos_token": "<|im_end|>"})
      tokenizer = tokenizers.HuggingFaceTokenizer(os.path.join(folder, "tokenizer.json"))
      self.assertEqual(chat.for_tokenizer(tokenizer).origin, "default")

  def test_a_broken_template_fails_at_start_naming_its_file(self):
    with tempfile.TemporaryDirectory() as tmp:
      folder = _folder(tmp, "broken", {"chat_template": "{% for m in messages %}"})
      with self.assertRaisesRegex(ValueError, "tokenizer_config.json is not valid Jinja"):
        chat.from_folder(folder)


class ServedChatTest(absltest.TestCase):
  """A converted Ouro served (configs/serve.py's program, in this process)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._tmp = tempfile.TemporaryDirectory()
    converted = _convert("ouro", os.path.join(cls._tmp.name, "ouro"))
    config = serve_config.get_config()
    config.serve.checkpoint = converted
    config.serve.max_num_seqs = 1  # Few step shapes: one row of 1 or 16 tokens.
    config.serve.max_num_batched_tokens = 16
    config.serve.prefill_block = 16
    config.serve.token_buckets = (16,)
    config.serve.warmup = False
    program.validate(config)
    app, cls.loop = program.build(config)
    cls.server = ServerThread(app, cls.loop).__enter__()
    cls.tok = tokenizers.HuggingFaceTokenizer(os.path.join(converted, "tokenizer.json"))
    cls.template = chat.for_tokenizer(cls.tok)

  @classmethod
  def tearDownClass(cls):
    cls.server.__exit__(None, None, None)
    cls._tmp.cleanup()
    super().tearDownClass()

  def tearDown(self):
    self.server.wait_idle()
    self.assertEqual(self.loop.pages_in_use(), 0)
    super().tearDown()

  def _post(self, path, body):
    status, out = client.request(self.server.url + path, "POST", body, timeout_s=_TIMEOUT_S)
    self.assertEqual(status, 200, out)
    return out

  def test_a_chat_is_the_completion_of_its_rendered_prompt(self):
    sampling = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    messages = _SHORT_CHAT
    ids = [int(t) for t in self.tok.encode(self.template.render(_parsed(messages)))]
    if transformers is not None:  # The prompt is transformers' (RenderTest checks it).
      hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(self.tok.path))
      want_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
      self.assertEqual(ids, list(want_ids["input_ids"]))
    reply = self._post(
      "/v1/chat/completions",
      {"messages": messages, **sampling, "logprobs": True, "top_logprobs": 2},
    )
    want = self._post("/v1/completions", {"prompt": ids, **sampling, "logprobs": 2})
    choice, want_choice = reply["choices"][0], want["choices"][0]
    self.assertEqual(reply["object"], "chat.completion")
    self.assertEqual(choice["message"], {"role": "assistant", "content": want_choice["text"]})
    self.assertEqual(choice["finish_reason"], want_choice["finish_reason"])
    self.assertEqual(reply["usage"], want["usage"])
    self.assertEqual(reply["usage"]["prompt_tokens"], len(ids))
    content = choice["logprobs"]["content"]
    legacy = want_choice["logprobs"]
    self.assertEqual([c["logprob"] for c in content], legacy["token_logprobs"])
    self.assertEqual([c["token"] for c in content], legacy["tokens"])
    for entry, top in zip(content, legacy["top_logprobs"]):
      self.assertEqual({t["token"]: t["logprob"] for t in entry["top_logprobs"]}, top)
      if not entry["token"].startswith("token_id:"):
        self.assertEqual(bytes(entry["bytes"]).decode("utf-8"), entry["token"])
    # Streamed: the role first, then deltas that concatenate to the reply, then the usage.
    stream = client.Stream(
      self.server.url + "/v1/chat/completions",
      {"messages": messages, **sampling, "stream_options": {"include_usage": True}},
      timeout_s=_TIMEOUT_S,
    )
    chunks = list(stream)
    stream.close()
    self.assertTrue(stream.done)
    self.assertEqual({c["object"] for c in chunks}, {"chat.completion.chunk"})
    self.assertEqual(chunks[0]["choices"][0]["delta"], {"role": "assistant", "content": ""})
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]]
    self.assertEqual("".join(deltas), choice["message"]["content"])
    self.assertEqual(chunks[-2]["choices"][0]["finish_reason"], choice["finish_reason"])
    self.assertEqual((chunks[-1]["choices"], chunks[-1]["usage"]), ([], reply["usage"]))

  def test_openai_client(self):
    api = openai.OpenAI(base_url=self.server.url + "/v1", api_key="unused", max_retries=0)
    messages = _CHATS[0]
    want = self._post(
      "/v1/chat/completions",
      {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    )
    out = api.chat.completions.create(
      model="ouro", messages=messages, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    self.assertEqual(out.choices[0].message.content, want["choices"][0]["message"]["content"])
    self.assertEqual(out.choices[0].message.role, "assistant")
    self.assertEqual(out.usage.completion_tokens, 5)
    events = api.chat.completions.create(
      model="ouro",
      messages=messages,
      max_completion_tokens=5,
      temperature=0,
      stream=True,
      extra_body={"ignore_eos": True},
    )
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    self.assertEqual(text, want["choices"][0]["message"]["content"])
    with self.assertRaises(openai.BadRequestError) as e:
      api.chat.completions.create(model="ouro", messages=[{"role": "tool", "content": "x"}])
    self.assertIn("messages[0].role", str(e.exception))


if __name__ == "__main__":
  absltest.main()
