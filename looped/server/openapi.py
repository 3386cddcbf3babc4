"""The server's OpenAPI 3.0 document, served at /openapi.json.

Written from protocol.py's rules and the served model's limits (vocabulary, context, logprobs,
batch size), not generated from handler signatures (the handlers read raw bodies so that each
refusal names its field): it tells clients what is accepted, and an API fuzzer (schemathesis,
tests/server_fuzz_test.py) sends what it allows and what it does not.
"""

from __future__ import annotations

from looped.engine import sampling
from looped.server import protocol

_ERROR = {
  "type": "object",
  "required": ["error"],
  "properties": {
    "error": {
      "type": "object",
      "required": ["message", "type"],
      "properties": {
        "message": {"type": "string"},
        "type": {"type": "string"},
        "param": {"type": "string", "nullable": True},
        "code": {"nullable": True},
      },
    }
  },
}


def _json(schema: dict, description: str) -> dict:
  return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict:
  why = {
    400: "a field is invalid (the message names it)",
    404: "another model is asked for",
    413: "the body is over serve.max_body_bytes",
    429: "the queue is full (retry later)",
    503: "the server is warming up or shutting down",
  }
  return {str(c): _json(_ERROR, why[c]) for c in codes}


def _completion_request(limits: protocol.Limits) -> dict:
  token = {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}
  text = {"type": "string", "minLength": 1}
  tokens = {"type": "array", "items": token, "minItems": 1}
  batch = {"minItems": 1, "maxItems": limits.max_batch}
  stop_text = {"type": "string", "minLength": 1, "maxLength": protocol.MAX_STOP_CHARS}
  return {
    "type": "object",
    "required": ["prompt"],
    "additionalProperties": False,
    "properties": {
      "model": {"type": "string", "enum": [limits.model_name]},
      "prompt": {
        "oneOf": [text, tokens, {"type": "array", "items": {"oneOf": [text, tokens]}, **batch}]
      },
      "max_tokens": {"type": "integer", "minimum": 1, "maximum": limits.max_model_len},
      "temperature": {"type": "number", "minimum": 0, "maximum": sampling.MAX_TEMPERATURE},
      "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1},
      "top_k": {"type": "integer", "minimum": -1, "maximum": limits.vocab_size},
      "seed": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1, "nullable": True},
      "stop": {
        "oneOf": [
          stop_text,
          {
            "type": "array",
            "items": stop_text,
            "maxItems": protocol.MAX_STOP_STRINGS,
          },
        ],
        "nullable": True,
      },
      "n": {"type": "integer", "enum": [1]},
      "stream": {"type": "boolean"},
      "stream_options": {
        "type": "object",
        "additionalProperties": False,
        "properties": {"include_usage": {"type": "boolean"}},
        "nullable": True,
      },
      "logprobs": {
        "type": "integer",
        "minimum": 0,
        "maximum": limits.max_logprobs,
        "nullable": True,
      },
      "echo": {"type": "boolean"},
      "ignore_eos": {"type": "boolean"},
      "user": {"type": "string"},
    },
  }


_LOGPROBS = {
  "type": "object",
  "nullable": True,
  "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
  "properties": {
    "tokens": {"type": "array", "items": {"type": "string"}},
    "token_logprobs": {"type": "array", "items": {"type": "number", "nullable": True}},
    "top_logprobs": {
      "type": "array",
      "items": {"type": "object", "nullable": True, "additionalProperties": {"type": "number"}},
    },
    "text_offset": {"type": "array", "items": {"type": "integer"}},
  },
}

_COMPLETION = {
  "type": "object",
  "required": ["id", "object", "created", "model", "choices", "usage"],
  "properties": {
    "id": {"type": "string"},
    "object": {"type": "string", "enum": ["text_completion"]},
    "created": {"type": "integer"},
    "model": {"type": "string"},
    "choices": {
      "type": "array",
      "items": {
        "type": "object",
        "required": ["index", "text", "logprobs", "finish_reason"],
        "properties": {
          "index": {"type": "integer", "minimum": 0},
          "text": {"type": "string"},
          "logprobs": _LOGPROBS,
          "finish_reason": {"type": "string", "enum": ["length", "stop"]},
        },
      },
    },
    "usage": {
      "type": "object",
      "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
      "properties": {
        k: {"type": "integer", "minimum": 0}
        for k in ("prompt_tokens", "completion_tokens", "total_tokens")
      },
    },
  },
}


def document(limits: protocol.Limits) -> dict:
  """The OpenAPI document of the server's routes for the served model's limits."""
  completion_ok = {
    "description": "the completion (a JSON object, or server-sent events with stream)",
    "content": {
      "application/json": {"schema": _COMPLETION},
      "text/event-stream": {
        "schema": {
          "type": "object",
          "required": ["data"],
          "properties": {"data": {"type": "string"}},
        }
      },
    },
  }
  tokens = {"type": "array", "items": {"type": "integer", "minimum": 0}}
  return {
    "openapi": "3.0.3",
    "info": {"title": "looped", "version": "1"},
    "paths": {
      "/v1/completions": {
        "post": {
          "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _completion_request(limits)}},
          },
          "responses": {"200": completion_ok, **_errors(400, 404, 413, 429, 503)},
        }
      },
      "/v1/models": {
        "get": {
          "responses": {
            "200": _json(
              {
                "type": "object",
                "required": ["object", "data"],
                "properties": {"object": {"type": "string"}, "data": {"type": "array"}},
              },
              "the served model",
            )
          }
        }
      },
      "/health": {
        "get": {
          "responses": {
            "200": _json({"type": "object"}, "ready"),
            **_errors(503),
          }
        }
      },
      "/tokenize": {
        "post": {
          "requestBody": {
            "required": True,
            "content": {
              "application/json": {
                "schema": {
                  "type": "object",
                  "required": ["prompt"],
                  "properties": {"prompt": {"type": "string"}},
                }
              }
            },
          },
          "responses": {
            "200": _json(
              {
                "type": "object",
                "required": ["tokens", "count", "max_model_len"],
                "properties": {
                  "tokens": tokens,
                  "count": {"type": "integer"},
                  "max_model_len": {"type": "integer"},
                },
              },
              "the prompt's token ids",
            ),
            **_errors(400, 413),
          },
        }
      },
      "/detokenize": {
        "post": {
          "requestBody": {
            "required": True,
            "content": {
              "application/json": {
                "schema": {
                  "type": "object",
                  "required": ["tokens"],
                  "properties": {"tokens": tokens},
                }
              }
            },
          },
          "responses": {
            "200": _json(
              {
                "type": "object",
                "required": ["prompt"],
                "properties": {"prompt": {"type": "string"}},
              },
              "the tokens' text",
            ),
            **_errors(400, 413),
          },
        }
      },
      "/tokenizer_info": {
        "get": {"responses": {"200": _json({"type": "object"}, "the served tokenizer")}}
      },
      "/metrics": {
        "get": {
          "responses": {
            "200": {
              "description": "Prometheus text format",
              "content": {"text/plain": {"schema": {"type": "string"}}},
            }
          }
        }
      },
    },
  }
