"""The OpenAPI document's Responses API routes: the request body of ``/v1/responses`` (text in,
text out, function tools as chat's), and the routes of a stored response (retrieve, its input
items, cancel)."""

from __future__ import annotations

from typing import Any

from fd.api.chat_template import MAX_TOOLS, ROLES
from fd.api.openapi_common import ERRORS, INT_OR_NULL, NULLABLE_BOOL, REQUEST_ID_PATTERN, RID_PATH, err, ref


def responses_request(sampling: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    return {
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
                                        "role": {"type": "string", "enum": list(ROLES)},
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
            "max_output_tokens": {**INT_OR_NULL, "minimum": 1, "maximum": max_model_len},
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
                            "strict": NULLABLE_BOOL,
                        },
                    }
                },
            },
            "previous_response_id": {
                "type": "string",
                "nullable": True,
                "pattern": REQUEST_ID_PATTERN,
                "description": "Go on from a stored response (its input and output come before this input).",
            },
            "store": {**NULLABLE_BOOL, "description": "false: keep no conversation to go on from."},
            "metadata": {
                "type": "object",
                "nullable": True,
                "maxProperties": 16,
                "propertyNames": {"maxLength": 64},
                "additionalProperties": {"type": "string", "maxLength": 512},
                "description": "Echoed on the Response (OpenAI's: keys up to 64 characters).",
            },
            "user": {"type": "string", "nullable": True, "description": "Echoed on the Response."},
            "truncation": {
                "type": "string",
                "nullable": True,
                "enum": ["auto", "disabled"],
                "description": "Echoed on the Response (as vLLM: a prompt too long is a 400 either way).",
            },
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
            "top_logprobs": {**INT_OR_NULL, "minimum": 0, "maximum": 20},
            "tools": {
                "type": "array",
                "nullable": True,
                "maxItems": MAX_TOOLS,
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
            "parallel_tool_calls": NULLABLE_BOOL,
        },
    }


def response() -> dict[str, Any]:
    """The answer, as far as the document says: OpenAI's object."""
    return {
        "type": "object",
        "required": ["id", "object", "status", "output"],
        "properties": {"object": {"type": "string", "enum": ["response"]}},
    }


def retrieve() -> dict[str, Any]:
    """``GET /v1/responses/{id}``"""
    return {
        "get": {
            "summary": "A response as it stands (OpenAI's retrieve), for its story's TTL; "
            "stream=true: its events, after starting_after, then live",
            "security": [{"apiKey": []}],
            "parameters": [
                RID_PATH,
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
                        "application/json": {"schema": ref("Response")},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                "400": ERRORS["400"],
                "401": ERRORS["401"],
                "404": err("Unknown or expired response"),
            },
        }
    }


def input_items() -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``"""
    return {
        "get": {
            "summary": "The conversation a response was given (after the one it went on from), "
            "as OpenAI's items, each with an id",
            "security": [{"apiKey": []}],
            "parameters": [RID_PATH],
            "responses": {
                "200": {"description": "{object: list, data: [items], first_id, last_id, has_more}"},
                "400": ERRORS["400"],
                "401": ERRORS["401"],
                "404": err("Unknown, expired or not stored"),
            },
        }
    }


def cancel(security: list[dict[str, list]]) -> dict[str, Any]:
    """``POST /v1/responses/{id}/cancel``"""
    return {
        "post": {
            "summary": "Abort a background response; answers with it once the abort's final is "
            "in (any other response: a 400)",
            "security": security,
            "parameters": [RID_PATH],
            "responses": {
                "200": {
                    "description": "The Response",
                    "content": {"application/json": {"schema": ref("Response")}},
                },
                "400": ERRORS["400"],
                "401": ERRORS["401"],
                "404": err("Unknown or expired response"),
            },
        }
    }
