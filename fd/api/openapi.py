"""The OpenAPI 3 document of the API node, served at ``GET /openapi.json``.

Built from the same constants the parses validate with (roles and limits, from
:mod:`fd.api.chat_template`, :mod:`fd.api.choices` and :mod:`fd.api.sampling`), so a
schema-driven client or fuzzer sees what the server really accepts. The schemas describe what
is *accepted*; anything outside them gets a 4xx with OpenAI's error shape, never a 5xx.

Auth, as documented here: ``--api-key`` (one or several keys, each a tenant that sees only its
own requests: :mod:`fd.api.tenancy`) guards every ``/v1/*`` route (Bearer); aborts by id take a
tenant's key or ``--admin-key``, ``abort_all`` and the LoRA routes the admin key (which also
works wherever an API key does). ``/health``,
``/metrics`` and this document are open: probes and scrapers carry no keys, and none of them
exposes a request id or any request content.

This module assembles the document and describes the node's own routes (models, health,
metrics, tokenize); each endpoint family's schemas and operations are beside it, built of the
pieces in :mod:`fd.api.openapi_common`: generation (chat, completions), responses, embeddings
(with score and rerank) and control (aborts, a request's stream, LoRA adapters).
"""

from __future__ import annotations

from typing import Any

from fd.api import (
    openapi_common,
    openapi_control,
    openapi_embeddings,
    openapi_generation,
    openapi_responses,
)
from fd.api.openapi_common import ERRORS, NULLABLE_BOOL, err, ref


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
    token_id = openapi_common.token_id(vocab_size)
    sampling = openapi_generation.sampling_props(model_name, max_model_len, aliases)
    embedding_props = openapi_embeddings.embedding_props(sampling, token_id, max_model_len)
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "fd API",
            "version": "1",
            "description": f"OpenAI-compatible API serving '{model_name}' (context {max_model_len} "
            f"tokens; request bodies up to {max_body_bytes} bytes).",
        },
        "components": {
            "schemas": {
                "Error": openapi_common.error(),
                "ChatMessage": openapi_generation.chat_message(),
                "ChatCompletionRequest": openapi_generation.chat_completion_request(sampling),
                "CompletionRequest": openapi_generation.completion_request(sampling, token_id),
                "ResponsesRequest": openapi_responses.responses_request(sampling, max_model_len),
                "EmbeddingRequest": openapi_embeddings.embedding_request(embedding_props),
                "EmbeddingList": openapi_embeddings.embedding_list(),
                "ScoreRequest": openapi_embeddings.score_request(sampling, embedding_props),
                "RerankRequest": openapi_embeddings.rerank_request(sampling, embedding_props),
                "AbortRequest": openapi_control.abort_request(),
                "AbortResponse": openapi_control.abort_response(),
                "ChatCompletion": openapi_generation.chat_completion(),
                "Completion": openapi_generation.completion(),
                "Response": openapi_responses.response(),
                "ModelList": {
                    "type": "object",
                    "properties": {
                        "object": {"type": "string"},
                        "data": {"type": "array", "items": {"type": "object"}},
                    },
                },
            },
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
            "/v1/chat/completions": openapi_generation.generating(
                "Chat completion", "ChatCompletionRequest", "ChatCompletion"
            ),
            "/v1/completions": openapi_generation.generating(
                "Text completion", "CompletionRequest", "Completion"
            ),
            "/v1/responses": openapi_generation.generating(
                "OpenAI's Responses API (text); stream=true sends its typed "
                "events, each frame naming its type",
                "ResponsesRequest",
                "Response",
            ),
            "/v1/embeddings": openapi_embeddings.embedding(
                "Embeddings (OpenAI's)",
                "EmbeddingRequest",
                "The inputs' embeddings, in order",
                "EmbeddingList",
            ),
            **openapi_embeddings.score_paths(),
            **openapi_embeddings.rerank_paths(),
            "/v1/models": {
                "get": {
                    "summary": "The served model",
                    "security": [{"apiKey": []}],
                    "responses": {
                        "200": {
                            "description": "Model list",
                            "content": {"application/json": {"schema": ref("ModelList")}},
                        },
                        "401": ERRORS["401"],
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
                        "401": ERRORS["401"],
                        "404": err("Not a served name"),
                    },
                }
            },
            "/v1/abort_requests": openapi_control.abort_requests(own),
            "/v1/requests/{id}/stream": openapi_control.request_stream(),
            "/v1/responses/{id}": openapi_responses.retrieve(),
            "/v1/responses/{id}/input_items": openapi_responses.input_items(),
            "/v1/responses/{id}/cancel": openapi_responses.cancel(own),
            "/v1/requests/{id}/cancel": openapi_control.request_cancel(own),
            "/v1/lifecycle": openapi_control.lifecycle(admin),
            **(openapi_control.lora_paths(admin) if runtime_lora else {}),
            "/health": {
                "get": {
                    "summary": "Ready when Redis answers and an engine is alive (no auth)",
                    "security": [],
                    "responses": {"200": {"description": "ok"}, "503": err("Redis or engines unavailable")},
                }
            },
            "/ping": {
                m: {
                    "summary": "vLLM's (SageMaker's) liveness route: /health's answer (no auth)",
                    "security": [],
                    "responses": {"200": {"description": "ok"}, "503": err("Redis or engines unavailable")},
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
                                            "items": ref("ChatMessage"),
                                        },
                                        **openapi_generation.chat_rendering_props(),
                                        "return_token_strs": {
                                            **NULLABLE_BOOL,
                                            "description": "the vocabulary's pieces too (token_strs)",
                                        },
                                    },
                                }
                            }
                        },
                    },
                    "responses": {
                        "200": {"description": "{count, max_model_len, tokens}"},
                        "400": ERRORS["400"],
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
                    "responses": {"200": {"description": "{prompt}"}, "400": ERRORS["400"]},
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
