"""The OpenAPI 3 document of the API node, served at ``GET /openapi.json``.

Built from the same constants :mod:`fd.api.protocol` validates with (roles, limits), so a
schema-driven client or fuzzer sees what the server really accepts. The schemas describe what
is *accepted*; anything outside them gets a 4xx with OpenAI's error shape, never a 5xx.

Auth, as documented here: ``--api-key`` (one or several keys, each a tenant that sees only its
own requests: :mod:`fd.api.tenancy`) guards every ``/v1/*`` route (Bearer); aborts by id take a
tenant's key or ``--admin-key``, ``abort_all`` and the LoRA routes the admin key (which also
works wherever an API key does). ``/health``,
``/metrics`` and this document are open: probes and scrapers carry no keys, and none of them
exposes a request id or any request content.
"""

from __future__ import annotations

from typing import Any

from control.keys import REQUEST_ID_RE
from control.sampling import MAX_LOGPROBS, MAX_REPETITION_PENALTY
from fd.api import protocol
from fd.api.embeddings import ENCODINGS, MAX_INPUTS

REQUEST_ID_PATTERN = REQUEST_ID_RE.pattern  # ECMA-262 as JSON Schema wants: "$" is the very end there


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


_NULLABLE_BOOL = {"type": "boolean", "nullable": True}
_INT_OR_NULL = {
    "type": "integer",
    "format": "int64",
    "nullable": True,
}  # JSON ints past 64 bits are not ints to orjson


def _sampling_props(model_name: str, max_model_len: int, aliases: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "model": {
            "type": "string",
            "nullable": True,
            "enum": [model_name, *aliases],
            "description": "The served model's name; omitted means the served model.",
        },
        "max_tokens": {**_INT_OR_NULL, "minimum": 1, "maximum": max_model_len},
        "max_completion_tokens": {**_INT_OR_NULL, "minimum": 1, "maximum": max_model_len},
        "temperature": {"type": "number", "nullable": True, "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "nullable": True, "exclusiveMinimum": True, "minimum": 0, "maximum": 1},
        "top_k": {**_INT_OR_NULL, "minimum": -1},
        "seed": {**_INT_OR_NULL, "minimum": 0, "maximum": 2**63 - 1},
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
        "min_tokens": {**_INT_OR_NULL, "minimum": 0, "maximum": max_model_len},
        "n": {
            "type": "integer",
            "nullable": True,
            "minimum": 1,
            "maximum": protocol.MAX_CHOICES,
            "description": "Choices; each runs as a request '<id>.<index>' (seeded: seed + index).",
        },
        "best_of": {
            "type": "integer",
            "nullable": True,
            "minimum": 1,
            "maximum": protocol.MAX_CHOICES,
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
            **_INT_OR_NULL,
            "description": "vLLM: on a server with --scheduling-policy "
            "priority, lower starts first (elsewhere only 0)",
        },
        "bad_words": {
            "type": "array",
            "nullable": True,
            "maxItems": protocol.MAX_BAD_WORDS,
            "items": {"type": "string"},
            "description": "vLLM: words the output may not complete.",
        },
        "ignore_eos": _NULLABLE_BOOL,
        "include_stop_str_in_output": _NULLABLE_BOOL,
        "skip_special_tokens": {
            **_NULLABLE_BOOL,
            "description": "Leave special tokens' text out of the output (the default).",
        },
        "stream": _NULLABLE_BOOL,
        "stream_options": {
            "type": "object",
            "nullable": True,
            "description": "Only with stream=true.",
            "properties": {
                "include_usage": _NULLABLE_BOOL,
                "continuous_usage_stats": {
                    **_NULLABLE_BOOL,
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
                        "strict": _NULLABLE_BOOL,
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
            **_NULLABLE_BOOL,
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
            **_INT_OR_NULL,
            "minimum": 0,
            "maximum": MAX_LOGPROBS,
            "description": "vLLM: each prompt token's log-probability and rank, "
            "with this many alternatives (not with stream, nor "
            "with echo).",
        },
        "return_token_ids": {
            **_NULLABLE_BOOL,
            "description": "vLLM: the prompt's token ids and each choice's output ids "
            "in the answer (streamed: each chunk its tokens').",
        },
        "return_tokens_as_token_ids": {
            **_NULLABLE_BOOL,
            "description": "vLLM: log-probabilities name their tokens 'token_id:<id>'.",
        },
    }


def _chat_rendering_props() -> dict[str, Any]:
    """vLLM's chat extensions on how the messages become the prompt (protocol.ChatRendering)."""
    return {
        "add_generation_prompt": {
            **_NULLABLE_BOOL,
            "description": "Open the assistant's turn (the default).",
        },
        "continue_final_message": {
            **_NULLABLE_BOOL,
            "description": "Go on with the last message, the assistant's (with add_generation_prompt false).",
        },
        "add_special_tokens": {
            **_NULLABLE_BOOL,
            "description": "The tokenizer's own special tokens (BOS) on top of the template's.",
        },
    }


def _schemas(
    model_name: str, max_model_len: int, vocab_size: int | None, aliases: tuple[str, ...] = ()
) -> dict[str, Any]:
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
    }
    function = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "description": {"type": "string"},
            "parameters": {"type": "object", "description": "A JSON Schema."},
        },
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
    message = {
        "oneOf": [
            {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string", "enum": list(protocol.ROLES)},
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
    sampling = _sampling_props(model_name, max_model_len, aliases)
    token_id: dict[str, Any] = {"type": "integer", "format": "int64", "minimum": 0}
    if vocab_size:
        token_id["maximum"] = vocab_size - 1
    # (/v1/embeddings' fields; the scoring routes take those that are not about vectors)
    embedding_props = {
        "model": sampling["model"],
        "input": {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": MAX_INPUTS,
                    "items": {
                        "oneOf": [
                            {"type": "string", "minLength": 1},
                            {"type": "array", "minItems": 1, "items": token_id},
                        ]
                    },
                },
                {"type": "array", "minItems": 1, "items": token_id},
            ],
            "description": f"Each input at most {max_model_len - 1} tokens.",
        },
        "encoding_format": {
            "type": "string",
            "enum": list(ENCODINGS),
            "default": "float",
            "description": "base64: the float32 values' little-endian bytes.",
        },
        "dimensions": {
            **_INT_OR_NULL,
            "minimum": 1,
            "description": "Only for a model whose config.json says is_matryoshka "
            "or matryoshka_dimensions: the vector cut to its first "
            "values (then normalized).",
        },
        "normalize": {**_NULLABLE_BOOL, "description": "vLLM's: false returns the hidden state as it is."},
        "add_special_tokens": {
            **_NULLABLE_BOOL,
            "description": "vLLM's (default true; with messages false).",
        },
        "messages": {
            "type": "array",
            "nullable": True,
            "minItems": 1,
            "items": _ref("ChatMessage"),
            "description": "vLLM's chat embeddings, instead of input: the conversation as the "
            "chat template renders it (no generation prompt unless asked).",
        },
        "add_generation_prompt": {**_NULLABLE_BOOL, "description": "With messages (default false)."},
        "continue_final_message": {**_NULLABLE_BOOL, "description": "With messages (vLLM's)."},
        "chat_template_kwargs": {
            "type": "object",
            "nullable": True,
            "description": "With messages (vLLM's).",
        },
        "truncate_prompt_tokens": sampling["truncate_prompt_tokens"],
        "priority": sampling["priority"],
        "user": {"type": "string"},
    }
    texts = {
        "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        ]
    }
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type", "param", "code"],
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": "string", "nullable": True},
                        "code": {"type": "string", "nullable": True},
                    },
                }
            },
        },
        "ChatMessage": message,
        "ChatCompletionRequest": {
            "type": "object",
            "required": ["messages"],
            "properties": {
                "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
                **sampling,
                "logprobs": _NULLABLE_BOOL,
                "top_logprobs": {**_INT_OR_NULL, "minimum": 0, "maximum": MAX_LOGPROBS},
                "tools": {
                    "type": "array",
                    "nullable": True,
                    "maxItems": protocol.MAX_TOOLS,
                    "items": {
                        "type": "object",
                        "required": ["type", "function"],
                        "properties": {
                            "type": {"type": "string", "enum": ["function"]},
                            "function": function,
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
                "parallel_tool_calls": _NULLABLE_BOOL,
                "chat_template_kwargs": {
                    "type": "object",
                    "nullable": True,
                    "description": "More variables for the chat template (vLLM's), such "
                    "as Qwen3's enable_thinking.",
                },
                **_chat_rendering_props(),
                "include_reasoning": {
                    **_NULLABLE_BOOL,
                    "description": "vLLM: on a server with a reasoning "
                    "parser, false leaves the thinking out.",
                },
            },
        },
        "CompletionRequest": {
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
                            "maxItems": protocol.MAX_BATCH,
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
                "logprobs": {**_INT_OR_NULL, "minimum": 0, "maximum": MAX_LOGPROBS},
                "echo": {
                    **_NULLABLE_BOOL,
                    "description": "The prompt before the completion; with logprobs, the "
                    "prompt's tokens scored too (the first has none). With "
                    "echo, max_tokens may be 0: the prompt scored alone.",
                },
            },
        },
        "ResponsesRequest": {
            "type": "object",
            "required": ["input"],
            "description": "OpenAI's Responses API over the chat template: text in, text out, "
            "function tools as chat's. Other tools and non-text input are refused.",
            "properties": {
                "model": sampling["model"],
                "input": {
                    "oneOf": [
                        {"type": "string", "minLength": 1},
                        {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "oneOf": [
                                    {
                                        "type": "object",
                                        "required": ["role", "content"],
                                        "properties": {
                                            "type": {"type": "string", "enum": ["message"]},
                                            "role": {"type": "string", "enum": list(protocol.ROLES)},
                                            "content": {
                                                "oneOf": [
                                                    {"type": "string"},
                                                    {
                                                        "type": "array",
                                                        "items": {
                                                            "type": "object",
                                                            "required": ["type", "text"],
                                                            "properties": {
                                                                "type": {
                                                                    "type": "string",
                                                                    "enum": [
                                                                        "input_text",
                                                                        "output_text",
                                                                        "text",
                                                                    ],
                                                                },
                                                                "text": {"type": "string"},
                                                            },
                                                        },
                                                    },
                                                ]
                                            },
                                        },
                                    },
                                    {
                                        "type": "object",
                                        "required": ["type", "call_id", "name", "arguments"],
                                        "description": "An earlier answer's call.",
                                        "properties": {
                                            "type": {"type": "string", "enum": ["function_call"]},
                                            "call_id": {"type": "string"},
                                            "name": {"type": "string"},
                                            "arguments": {"type": "string"},
                                        },
                                    },
                                    {
                                        "type": "object",
                                        "required": ["type", "call_id", "output"],
                                        "description": "A call's result.",
                                        "properties": {
                                            "type": {"type": "string", "enum": ["function_call_output"]},
                                            "call_id": {"type": "string"},
                                            "output": {"type": "string"},
                                        },
                                    },
                                ]
                            },
                        },
                    ]
                },
                "instructions": {
                    "type": "string",
                    "nullable": True,
                    "description": "A system message before the input.",
                },
                "max_output_tokens": {**_INT_OR_NULL, "minimum": 1, "maximum": max_model_len},
                **{
                    k: sampling[k]
                    for k in (
                        "temperature",
                        "top_p",
                        "stream",
                        "background",
                        "seed",
                        "top_k",
                        "min_p",
                        "ignore_eos",
                    )
                },
                "text": {
                    "type": "object",
                    "nullable": True,
                    "properties": {
                        "format": {
                            "type": "object",
                            "required": ["type"],
                            "properties": {
                                "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                                "name": {"type": "string"},
                                "schema": {"type": "object"},
                                "strict": _NULLABLE_BOOL,
                            },
                        }
                    },
                },
                "previous_response_id": {
                    "type": "string",
                    "nullable": True,
                    "pattern": REQUEST_ID_PATTERN,
                    "description": "Go on from a stored response (its input and "
                    "output come before this input).",
                },
                "store": {**_NULLABLE_BOOL, "description": "false: keep no conversation to go on from."},
                "include": {
                    "type": "array",
                    "nullable": True,
                    "items": {
                        "type": "string",
                        "enum": ["message.output_text.logprobs", "reasoning.encrypted_content"],
                    },
                    "description": "message.output_text.logprobs: the answer's log-probabilities (an "
                    "answer with no thinking and no tools).",
                },
                "top_logprobs": {**_INT_OR_NULL, "minimum": 0, "maximum": 20},
                "tools": {
                    "type": "array",
                    "nullable": True,
                    "maxItems": protocol.MAX_TOOLS,
                    "items": {
                        "type": "object",
                        "required": ["type", "name"],
                        "properties": {
                            "type": {"type": "string", "enum": ["function"]},
                            "name": {"type": "string", "minLength": 1},
                            "description": {"type": "string"},
                            "parameters": {"type": "object"},
                        },
                    },
                },
                "tool_choice": {
                    "nullable": True,
                    "oneOf": [
                        {"type": "string", "enum": ["none", "auto", "required"]},
                        {
                            "type": "object",
                            "required": ["type", "name"],
                            "properties": {
                                "type": {"type": "string", "enum": ["function"]},
                                "name": {"type": "string"},
                            },
                        },
                    ],
                    "description": "As chat's: auto (the default with tools) needs a server with "
                    "--enable-auto-tool-choice --tool-call-parser.",
                },
                "parallel_tool_calls": _NULLABLE_BOOL,
            },
        },
        "EmbeddingRequest": {
            "type": "object",
            "required": ["input"],
            "description": "Each input's embedding: the model's final hidden state at its last token "
            "(vLLM's LAST pooling), L2-normalized unless normalize is false.",
            "properties": embedding_props,
        },
        "EmbeddingList": {
            "type": "object",
            "required": ["object", "data", "usage"],
            "properties": {
                "object": {"type": "string", "enum": ["list"]},
                "data": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "object": {"type": "string", "enum": ["embedding"]},
                            "index": {"type": "integer"},
                            "embedding": {
                                "oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]
                            },
                        },
                    },
                },
            },
        },
        "ScoreRequest": {
            "type": "object",
            "required": ["text_1", "text_2"],
            "description": "vLLM's score over an embedding model: the cosine similarity of text_1 and "
            "each text_2 (one text_1, or as many as text_2: pairwise).",
            "properties": {
                "model": sampling["model"],
                "text_1": texts,
                "text_2": texts,
                **{
                    k: embedding_props[k]
                    for k in ("add_special_tokens", "truncate_prompt_tokens", "priority", "user")
                },
            },
        },
        "RerankRequest": {
            "type": "object",
            "required": ["query", "documents"],
            "description": "vLLM's rerank (Jina's and Cohere's API) over an embedding model: documents "
            "by the cosine similarity of their embedding to the query's, best first.",
            "properties": {
                "model": sampling["model"],
                "query": {"type": "string", "minLength": 1},
                "documents": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                "top_n": {**_INT_OR_NULL, "minimum": 0, "description": "0 or absent: every document"},
                **{
                    k: embedding_props[k]
                    for k in ("add_special_tokens", "truncate_prompt_tokens", "priority", "user")
                },
            },
        },
        "AbortRequest": {
            "type": "object",
            "description": "One of req_ids (FastDeploy), request_ids (vLLM) or abort_all.",
            "properties": {
                "req_ids": {"type": "array", "items": {"type": "string", "pattern": REQUEST_ID_PATTERN}},
                "request_ids": {"type": "array", "items": {"type": "string", "pattern": REQUEST_ID_PATTERN}},
                "abort_all": {"type": "boolean"},
                "engine": {"type": "string", "description": "with abort_all: only this engine"},
            },
        },
        "AbortResponse": {
            "type": "object",
            "properties": {
                "abort_id": {"type": "string"},
                "accepted": {"type": "array", "items": {"type": "string"}},
                "rejected": {"type": "array", "items": {"type": "object"}},
                "abort_all": {"type": "boolean"},
            },
        },
        "ChatCompletion": {
            "type": "object",
            "required": ["id", "object", "choices"],
            "properties": {"object": {"type": "string", "enum": ["chat.completion"]}},
        },
        "Completion": {
            "type": "object",
            "required": ["id", "object", "choices"],
            "properties": {"object": {"type": "string", "enum": ["text_completion"]}},
        },
        "Response": {
            "type": "object",
            "required": ["id", "object", "status", "output"],
            "properties": {"object": {"type": "string", "enum": ["response"]}},
        },
        "ModelList": {
            "type": "object",
            "properties": {
                "object": {"type": "string"},
                "data": {"type": "array", "items": {"type": "object"}},
            },
        },
    }


def _err(desc: str) -> dict:
    return {"description": desc, "content": {"application/json": {"schema": _ref("Error")}}}


_ERRORS = {
    "400": _err("Invalid request"),
    "401": _err("Missing or wrong key"),
    "413": _err("Body larger than the limit"),
}
_RID_HEADER = {
    "name": "X-Request-Id",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "pattern": REQUEST_ID_PATTERN, "maxLength": 128},
}
_RID_PATH = {
    "name": "id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": REQUEST_ID_PATTERN, "maxLength": 128},
}


def _generating(summary: str, req: str, resp: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "security": [{"apiKey": []}],
            "parameters": [_RID_HEADER],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(req)}}},
            "responses": {
                "200": {
                    "description": "The completion (JSON), or an SSE stream with stream=true",
                    "content": {
                        "application/json": {"schema": _ref(resp)},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_ERRORS,
                "404": _err("Unknown model"),
                "409": _err("X-Request-Id already used"),
            },
        }
    }


def _embedding(summary: str, req: str, answer: str, resp: str | None = None) -> dict:
    schema = _ref(resp) if resp else {"type": "object"}
    return {
        "post": {
            "summary": summary,
            "security": [{"apiKey": []}],
            "parameters": [_RID_HEADER],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(req)}}},
            "responses": {
                "200": {"description": answer, "content": {"application/json": {"schema": schema}}},
                **_ERRORS,
                "404": _err("Unknown model"),
                "409": _err("X-Request-Id already used"),
            },
        }
    }


def build(
    model_name: str,
    max_model_len: int,
    max_body_bytes: int,
    vocab_size: int | None = None,
    aliases: tuple[str, ...] = (),
    runtime_lora: bool = False,
) -> dict[str, Any]:
    """The document for one API node's configuration.

    Rules no schema can say: prompt tokens plus ``max_tokens`` must fit the context
    (``max_model_len``; past it, 400 ``context_length_exceeded``); ``stream_options`` needs
    ``stream``, ``top_logprobs`` above 0 needs ``logprobs``, ``min_tokens`` is at most
    ``max_tokens``, ``logit_bias`` keys are token ids of the vocabulary, and ``best_of`` equals
    ``n`` (400 naming the parameter)."""
    admin = [{"adminKey": []}]
    own = [{"apiKey": []}, {"adminKey": []}]  # a tenant's own requests, or the admin's any
    token_id: dict[str, Any] = {"type": "integer", "format": "int64", "minimum": 0}
    if vocab_size:
        token_id["maximum"] = vocab_size - 1
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "fd API",
            "version": "1",
            "description": f"OpenAI-compatible API serving '{model_name}' (context {max_model_len} "
            f"tokens; request bodies up to {max_body_bytes} bytes).",
        },
        "components": {
            "schemas": _schemas(model_name, max_model_len, vocab_size, aliases),
            "securitySchemes": {
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "one of --api-key's keys: a tenant, which sees and aborts "
                    "only its own requests (any other id answers as an unknown one)",
                },
                "adminKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "--admin-key (else a lone --api-key): every request, "
                    "abort_all, LoRA adapters",
                },
            },
        },
        "paths": {
            "/v1/chat/completions": _generating("Chat completion", "ChatCompletionRequest", "ChatCompletion"),
            "/v1/completions": _generating("Text completion", "CompletionRequest", "Completion"),
            "/v1/responses": _generating(
                "OpenAI's Responses API (text); stream=true sends its typed "
                "events, each frame naming its type",
                "ResponsesRequest",
                "Response",
            ),
            "/v1/embeddings": _embedding(
                "Embeddings (OpenAI's)",
                "EmbeddingRequest",
                "The inputs' embeddings, in order",
                "EmbeddingList",
            ),
            **{
                p: _embedding(
                    "vLLM's score: cosine similarities of embeddings",
                    "ScoreRequest",
                    "One score a pair, in text_2's order",
                )
                for p in ("/score", "/v1/score")
            },
            **{
                p: _embedding(
                    "vLLM's rerank (Jina's and Cohere's API) by embeddings",
                    "RerankRequest",
                    "results: the documents best first, each with its index and relevance_score",
                )
                for p in ("/rerank", "/v1/rerank", "/v2/rerank")
            },
            "/v1/models": {
                "get": {
                    "summary": "The served model",
                    "security": [{"apiKey": []}],
                    "responses": {
                        "200": {
                            "description": "Model list",
                            "content": {"application/json": {"schema": _ref("ModelList")}},
                        },
                        "401": _ERRORS["401"],
                    },
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "One served name's model card (OpenAI's retrieve)",
                    "security": [{"apiKey": []}],
                    "parameters": [
                        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
                    ],
                    "responses": {
                        "200": {"description": "Model card"},
                        "401": _ERRORS["401"],
                        "404": _err("Not a served name"),
                    },
                }
            },
            "/v1/abort_requests": {
                "post": {
                    "summary": "Abort requests by id (a tenant: its own), or all (the admin key); answers at once",
                    "security": own,
                    "parameters": [
                        {
                            "name": "wait",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "number", "minimum": 0},
                            "description": "seconds to wait for the finals (the old synchronous answer)",
                        }
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("AbortRequest")}},
                    },
                    "responses": {
                        "200": {
                            "description": "Abort published",
                            "content": {"application/json": {"schema": _ref("AbortResponse")}},
                        },
                        **_ERRORS,
                    },
                }
            },
            "/v1/requests/{id}/stream": {
                "get": {
                    "summary": "Replay / resume a request's SSE stream (Last-Event-ID)",
                    "security": [{"apiKey": []}],
                    "parameters": [
                        _RID_PATH,
                        {
                            "name": "Last-Event-ID",
                            "in": "header",
                            "required": False,
                            "schema": {"type": "string"},
                        },
                    ],
                    "responses": {
                        "200": {
                            "description": "SSE stream",
                            "content": {"text/event-stream": {"schema": {"type": "string"}}},
                        },
                        "400": _ERRORS["400"],
                        "401": _ERRORS["401"],
                        "404": _err("Unknown or expired request"),
                    },
                }
            },
            "/v1/responses/{id}": {
                "get": {
                    "summary": "A response as it stands (OpenAI's retrieve), for its story's TTL; "
                    "stream=true: its events, after starting_after, then live",
                    "security": [{"apiKey": []}],
                    "parameters": [
                        _RID_PATH,
                        {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}},
                        {
                            "name": "starting_after",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "integer"},
                        },
                    ],
                    "responses": {
                        "200": {
                            "description": "The Response, or its SSE stream",
                            "content": {
                                "application/json": {"schema": _ref("Response")},
                                "text/event-stream": {"schema": {"type": "string"}},
                            },
                        },
                        "400": _ERRORS["400"],
                        "401": _ERRORS["401"],
                        "404": _err("Unknown or expired response"),
                    },
                }
            },
            "/v1/responses/{id}/input_items": {
                "get": {
                    "summary": "The conversation a response was given (after the one it went on from)",
                    "security": [{"apiKey": []}],
                    "parameters": [_RID_PATH],
                    "responses": {
                        "200": {"description": "{object: list, data: [items]}"},
                        "400": _ERRORS["400"],
                        "401": _ERRORS["401"],
                        "404": _err("Unknown, expired or not stored"),
                    },
                }
            },
            "/v1/responses/{id}/cancel": {
                "post": {
                    "summary": "Abort a response; answers with it once the abort's final is in",
                    "security": own,
                    "parameters": [_RID_PATH],
                    "responses": {
                        "200": {
                            "description": "The Response",
                            "content": {"application/json": {"schema": _ref("Response")}},
                        },
                        "400": _ERRORS["400"],
                        "401": _ERRORS["401"],
                        "404": _err("Unknown or expired response"),
                    },
                }
            },
            "/v1/requests/{id}/cancel": {
                "post": {
                    "summary": "Abort one request; answers at once",
                    "security": own,
                    "parameters": [_RID_PATH],
                    "responses": {
                        "200": {
                            "description": "Abort published",
                            "content": {"application/json": {"schema": _ref("AbortResponse")}},
                        },
                        "400": _ERRORS["400"],
                        "401": _ERRORS["401"],
                    },
                }
            },
            **(
                {
                    path: {
                        "post": {
                            "summary": summary,
                            "security": admin,
                            "requestBody": {
                                "required": True,
                                "content": {
                                    "application/json": {
                                        "schema": {
                                            "type": "object",
                                            "required": required,
                                            "properties": {
                                                k: {"type": "string"}
                                                for k in ("lora_name", "lora_path")[: len(required)]
                                            },
                                        }
                                    }
                                },
                            },
                            "responses": {
                                "200": {
                                    "description": "Success: ... (text)",
                                    "content": {"text/plain": {"schema": {"type": "string"}}},
                                },
                                "400": _ERRORS["400"],
                                "401": _ERRORS["401"],
                                "404": _err("No such adapter"),
                                "503": _err("Not every engine loaded it in time"),
                            },
                        }
                    }
                    for path, summary, required in (
                        (
                            "/v1/load_lora_adapter",
                            "vLLM's: load a LoRA adapter on every engine",
                            ["lora_name", "lora_path"],
                        ),
                        (
                            "/v1/unload_lora_adapter",
                            "vLLM's: unload a LoRA adapter loaded at run time",
                            ["lora_name"],
                        ),
                    )
                }
                if runtime_lora
                else {}
            ),
            "/health": {
                "get": {
                    "summary": "Ready when Redis answers and an engine is alive (no auth)",
                    "security": [],
                    "responses": {"200": {"description": "ok"}, "503": _err("Redis or engines unavailable")},
                }
            },
            "/ping": {
                m: {
                    "summary": "vLLM's (SageMaker's) liveness route: /health's answer (no auth)",
                    "security": [],
                    "responses": {"200": {"description": "ok"}, "503": _err("Redis or engines unavailable")},
                }
                for m in ("get", "post")
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (no auth)",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document (no auth)",
                    "security": [],
                    "responses": {"200": {"description": "OpenAPI 3 document"}},
                }
            },
            "/tokenize": {
                "post": {
                    "summary": "vLLM's: a prompt or chat messages as the model's token ids (no auth)",
                    "security": [],
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "properties": {
                                        "model": {
                                            "type": "string",
                                            "nullable": True,
                                            "enum": [model_name, *aliases],
                                        },
                                        "prompt": {"type": "string"},
                                        "messages": {
                                            "type": "array",
                                            "minItems": 1,
                                            "items": _ref("ChatMessage"),
                                        },
                                        **_chat_rendering_props(),
                                        "return_token_strs": {
                                            **_NULLABLE_BOOL,
                                            "description": "the vocabulary's pieces too (token_strs)",
                                        },
                                    },
                                }
                            }
                        },
                    },
                    "responses": {
                        "200": {"description": "{count, max_model_len, tokens}"},
                        "400": _ERRORS["400"],
                    },
                }
            },
            "/detokenize": {
                "post": {
                    "summary": "vLLM's: token ids as text (no auth)",
                    "security": [],
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["tokens"],
                                    "properties": {
                                        "model": {
                                            "type": "string",
                                            "nullable": True,
                                            "enum": [model_name, *aliases],
                                        },
                                        "tokens": {"type": "array", "items": token_id},
                                    },
                                }
                            }
                        },
                    },
                    "responses": {"200": {"description": "{prompt}"}, "400": _ERRORS["400"]},
                }
            },
            "/version": {
                "get": {
                    "summary": "fd's version (no auth)",
                    "security": [],
                    "responses": {"200": {"description": "{version}"}},
                }
            },
        },
    }
