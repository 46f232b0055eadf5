"""The OpenAPI document's generating routes, ``/v1/chat/completions`` and ``/v1/completions``:
their request bodies (with the sampling fields the Responses API takes too), the chat message,
and the one operation shape every generating route has (:func:`generating`)."""

from __future__ import annotations

from typing import Any

from fd.api.chat_template import MAX_TOOLS, ROLES
from fd.api.choices import MAX_BATCH, MAX_CHOICES
from fd.api.openapi_common import ERRORS, INT_OR_NULL, NULLABLE_BOOL, RID_HEADER, err, ref
from fd.api.sampling import MAX_BAD_WORDS
from fd.control.sampling import MAX_LOGPROBS, MAX_REPETITION_PENALTY


def sampling_props(model_name: str, max_model_len: int, aliases: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "model": {
            "type": "string",
            "nullable": True,
            "enum": [model_name, *aliases],
            "description": "The served model's name; omitted means the served model.",
        },
        "max_tokens": {**INT_OR_NULL, "minimum": 1, "maximum": max_model_len},
        "max_completion_tokens": {**INT_OR_NULL, "minimum": 1, "maximum": max_model_len},
        "temperature": {"type": "number", "nullable": True, "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "nullable": True, "exclusiveMinimum": True, "minimum": 0, "maximum": 1},
        "top_k": {**INT_OR_NULL, "minimum": -1},
        "seed": {**INT_OR_NULL, "minimum": 0, "maximum": 2**63 - 1},
        "presence_penalty": {"type": "number", "nullable": True, "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "nullable": True, "minimum": -2, "maximum": 2},
        "repetition_penalty": {
            "type": "number",
            "nullable": True,
            "exclusiveMinimum": True,
            "minimum": 0,
            "maximum": MAX_REPETITION_PENALTY,
        },
        "logit_bias": {
            "type": "object",
            "nullable": True,
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
        "min_p": {"type": "number", "nullable": True, "minimum": 0, "maximum": 1},
        "min_tokens": {**INT_OR_NULL, "minimum": 0, "maximum": max_model_len},
        "n": {
            "type": "integer",
            "nullable": True,
            "minimum": 1,
            "maximum": MAX_CHOICES,
            "description": "Choices; each runs as a request '<id>.<index>' (seeded: seed + index).",
        },
        "best_of": {
            "type": "integer",
            "nullable": True,
            "minimum": 1,
            "maximum": MAX_CHOICES,
            "description": "Only equal to n.",
        },
        "stop": {
            "nullable": True,
            "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
        },
        "stop_token_ids": {
            "type": "array",
            "nullable": True,
            "items": {"type": "integer", "format": "int64", "minimum": 0},
        },
        "allowed_token_ids": {
            "type": "array",
            "nullable": True,
            "minItems": 1,
            "items": {"type": "integer", "format": "int64", "minimum": 0},
            "description": "vLLM: only these tokens may be sampled.",
        },
        "priority": {
            **INT_OR_NULL,
            "description": "vLLM: on a server with --scheduling-policy "
            "priority, lower starts first (elsewhere only 0)",
        },
        "bad_words": {
            "type": "array",
            "nullable": True,
            "maxItems": MAX_BAD_WORDS,
            "items": {"type": "string"},
            "description": "vLLM: words the output may not complete.",
        },
        "ignore_eos": NULLABLE_BOOL,
        "include_stop_str_in_output": NULLABLE_BOOL,
        "skip_special_tokens": {
            **NULLABLE_BOOL,
            "description": "Leave special tokens' text out of the output (the default).",
        },
        "stream": NULLABLE_BOOL,
        "stream_options": {
            "type": "object",
            "nullable": True,
            "description": "Only with stream=true.",
            "properties": {
                "include_usage": NULLABLE_BOOL,
                "continuous_usage_stats": {
                    **NULLABLE_BOOL,
                    "description": "vLLM: with include_usage, the usage so far on every chunk.",
                },
            },
        },
        "response_format": {
            "type": "object",
            "nullable": True,
            "required": ["type"],
            "description": "json_object: any JSON object; json_schema: {name, schema}. The output "
            "is constrained to it (guided decoding).",
            "properties": {
                "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                "json_schema": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "schema": {"type": "object"},
                        "strict": NULLABLE_BOOL,
                    },
                },
            },
        },
        "guided_regex": {
            "type": "string",
            "nullable": True,
            "minLength": 1,
            "description": "vLLM: the output matches this regular expression.",
        },
        "guided_choice": {
            "type": "array",
            "nullable": True,
            "minItems": 1,
            "items": {"type": "string", "minLength": 1},
            "description": "vLLM: the output is one of these.",
        },
        "background": {
            **NULLABLE_BOOL,
            "description": "fd: a client disconnect does not abort the request; "
            "stream it later from GET /v1/requests/{id}/stream.",
        },
        "truncate_prompt_tokens": {
            "nullable": True,
            "oneOf": [
                {"type": "integer", "enum": [-1]},
                {"type": "integer", "minimum": 1, "maximum": max_model_len},
            ],
            "description": "vLLM: keep only the prompt's last k tokens (-1: as many as the context holds).",
        },
        "prompt_logprobs": {
            **INT_OR_NULL,
            "minimum": 0,
            "maximum": MAX_LOGPROBS,
            "description": "vLLM: each prompt token's log-probability and rank, "
            "with this many alternatives (not with stream, nor "
            "with echo).",
        },
        "return_token_ids": {
            **NULLABLE_BOOL,
            "description": "vLLM: the prompt's token ids and each choice's output ids "
            "in the answer (streamed: each chunk its tokens').",
        },
        "return_tokens_as_token_ids": {
            **NULLABLE_BOOL,
            "description": "vLLM: log-probabilities name their tokens 'token_id:<id>'.",
        },
    }


def chat_rendering_props() -> dict[str, Any]:
    """vLLM's chat extensions on how the messages become the prompt (fd.api.chat_template.ChatRendering)."""
    return {
        "add_generation_prompt": {
            **NULLABLE_BOOL,
            "description": "Open the assistant's turn (the default).",
        },
        "continue_final_message": {
            **NULLABLE_BOOL,
            "description": "Go on with the last message, the assistant's (with add_generation_prompt false).",
        },
        "add_special_tokens": {
            **NULLABLE_BOOL,
            "description": "The tokenizer's own special tokens (BOS) on top of the template's.",
        },
    }


def _function() -> dict[str, Any]:
    """A tool's function, as chat's tools declare it."""
    return {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "description": {"type": "string"},
            "parameters": {"type": "object", "description": "A JSON Schema."},
        },
    }


def chat_message() -> dict[str, Any]:
    """A chat message: a role's content (text, or text parts), or an assistant's earlier calls."""
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
    }
    call = {
        "type": "object",
        "required": ["function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"type": "string", "enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "arguments": {"type": "string", "description": "JSON text."},
                },
            },
        },
    }
    content = {"oneOf": [{"type": "string"}, {"type": "array", "items": text_part}]}
    return {
        "oneOf": [
            {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string", "enum": list(ROLES)},
                    "content": content,
                    "name": {"type": "string"},
                    "tool_call_id": {
                        "type": "string",
                        "description": "A tool's answer: the call it answers.",
                    },
                },
            },
            {
                "type": "object",
                "required": ["role", "tool_calls"],
                "description": "An assistant's earlier calls.",
                "properties": {
                    "role": {"type": "string", "enum": ["assistant"]},
                    "content": {**content, "nullable": True},
                    "tool_calls": {"type": "array", "minItems": 1, "items": call},
                },
            },
        ]
    }


def chat_completion_request(sampling: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "messages": {"type": "array", "minItems": 1, "items": ref("ChatMessage")},
            **sampling,
            "logprobs": NULLABLE_BOOL,
            "top_logprobs": {**INT_OR_NULL, "minimum": 0, "maximum": MAX_LOGPROBS},
            "tools": {
                "type": "array",
                "nullable": True,
                "maxItems": MAX_TOOLS,
                "items": {
                    "type": "object",
                    "required": ["type", "function"],
                    "properties": {
                        "type": {"type": "string", "enum": ["function"]},
                        "function": _function(),
                    },
                },
            },
            "tool_choice": {
                "nullable": True,
                "oneOf": [
                    {"type": "string", "enum": ["none", "auto", "required"]},
                    {
                        "type": "object",
                        "required": ["type", "function"],
                        "properties": {
                            "type": {"type": "string", "enum": ["function"]},
                            "function": {
                                "type": "object",
                                "required": ["name"],
                                "properties": {"name": {"type": "string"}},
                            },
                        },
                    },
                ],
                "description": "auto (the default with tools) needs a server started "
                "with --enable-auto-tool-choice --tool-call-parser; "
                "required and a named function guide the answer to "
                "the tools' schemas.",
            },
            "parallel_tool_calls": NULLABLE_BOOL,
            "chat_template_kwargs": {
                "type": "object",
                "nullable": True,
                "description": "More variables for the chat template (vLLM's), such "
                "as Qwen3's enable_thinking.",
            },
            **chat_rendering_props(),
            "include_reasoning": {
                **NULLABLE_BOOL,
                "description": "vLLM: on a server with a reasoning parser, false leaves the thinking out.",
            },
        },
    }


def completion_request(sampling: dict[str, Any], token_id: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "prompt": {
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "minItems": 1, "items": token_id},
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_BATCH,
                        "description": "A batch: prompt i's j-th choice is choice i * n + j.",
                        "items": {
                            "oneOf": [
                                {"type": "string", "minLength": 1},
                                {"type": "array", "minItems": 1, "items": token_id},
                            ]
                        },
                    },
                ]
            },
            **sampling,
            "logprobs": {**INT_OR_NULL, "minimum": 0, "maximum": MAX_LOGPROBS},
            "echo": {
                **NULLABLE_BOOL,
                "description": "The prompt before the completion; with logprobs, the "
                "prompt's tokens scored too (the first has none). With "
                "echo, max_tokens may be 0: the prompt scored alone.",
            },
        },
    }


def chat_completion() -> dict[str, Any]:
    """The answer, as far as the document says: OpenAI's object."""
    return {
        "type": "object",
        "required": ["id", "object", "choices"],
        "properties": {"object": {"type": "string", "enum": ["chat.completion"]}},
    }


def completion() -> dict[str, Any]:
    """The answer, as far as the document says: OpenAI's object."""
    return {
        "type": "object",
        "required": ["id", "object", "choices"],
        "properties": {"object": {"type": "string", "enum": ["text_completion"]}},
    }


def generating(summary: str, req: str, resp: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "security": [{"apiKey": []}],
            "parameters": [RID_HEADER],
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref(req)}}},
            "responses": {
                "200": {
                    "description": "The completion (JSON), or an SSE stream with stream=true",
                    "content": {
                        "application/json": {"schema": ref(resp)},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **ERRORS,
                "404": err("Unknown model"),
                "409": err("X-Request-Id already used"),
            },
        }
    }
