"""The OpenAPI document's embedding routes: ``/v1/embeddings`` and vLLM's score and rerank over
an embedding model, which take its fields that are not about vectors."""

from __future__ import annotations

from typing import Any

from fd.api.embeddings import ENCODINGS, MAX_INPUTS
from fd.api.openapi_common import ERRORS, INT_OR_NULL, NULLABLE_BOOL, RID_HEADER, err, ref


def embedding_props(sampling: dict[str, Any], token_id: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    """``/v1/embeddings``' fields; the scoring routes take those that are not about vectors."""
    return {
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
            **INT_OR_NULL,
            "minimum": 1,
            "description": "Only for a model whose config.json says is_matryoshka "
            "or matryoshka_dimensions: the vector cut to its first "
            "values (then normalized).",
        },
        "normalize": {**NULLABLE_BOOL, "description": "vLLM's: false returns the hidden state as it is."},
        "add_special_tokens": {
            **NULLABLE_BOOL,
            "description": "vLLM's (default true; with messages false).",
        },
        "messages": {
            "type": "array",
            "nullable": True,
            "minItems": 1,
            "items": ref("ChatMessage"),
            "description": "vLLM's chat embeddings, instead of input: the conversation as the "
            "chat template renders it (no generation prompt unless asked).",
        },
        "add_generation_prompt": {**NULLABLE_BOOL, "description": "With messages (default false)."},
        "continue_final_message": {**NULLABLE_BOOL, "description": "With messages (vLLM's)."},
        "chat_template_kwargs": {
            "type": "object",
            "nullable": True,
            "description": "With messages (vLLM's).",
        },
        "truncate_prompt_tokens": sampling["truncate_prompt_tokens"],
        "priority": sampling["priority"],
        "user": {"type": "string"},
    }


def _texts() -> dict[str, Any]:
    return {
        "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        ]
    }


def embedding_request(embedding_props: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["input"],
        "description": "Each input's embedding: the model's final hidden state at its last token "
        "(vLLM's LAST pooling), L2-normalized unless normalize is false.",
        "properties": embedding_props,
    }


def embedding_list() -> dict[str, Any]:
    return {
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
    }


def score_request(sampling: dict[str, Any], embedding_props: dict[str, Any]) -> dict[str, Any]:
    texts = _texts()
    return {
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
    }


def rerank_request(sampling: dict[str, Any], embedding_props: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["query", "documents"],
        "description": "vLLM's rerank (Jina's and Cohere's API) over an embedding model: documents "
        "by the cosine similarity of their embedding to the query's, best first.",
        "properties": {
            "model": sampling["model"],
            "query": {"type": "string", "minLength": 1},
            "documents": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            "top_n": {**INT_OR_NULL, "minimum": 0, "description": "0 or absent: every document"},
            **{
                k: embedding_props[k]
                for k in ("add_special_tokens", "truncate_prompt_tokens", "priority", "user")
            },
        },
    }


def embedding(summary: str, req: str, answer: str, resp: str | None = None) -> dict:
    schema = ref(resp) if resp else {"type": "object"}
    return {
        "post": {
            "summary": summary,
            "security": [{"apiKey": []}],
            "parameters": [RID_HEADER],
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref(req)}}},
            "responses": {
                "200": {"description": answer, "content": {"application/json": {"schema": schema}}},
                **ERRORS,
                "404": err("Unknown model"),
                "409": err("X-Request-Id already used"),
            },
        }
    }


def score_paths() -> dict[str, Any]:
    """vLLM's score, at both of its paths."""
    return {
        p: embedding(
            "vLLM's score: cosine similarities of embeddings",
            "ScoreRequest",
            "One score a pair, in text_2's order",
        )
        for p in ("/score", "/v1/score")
    }


def rerank_paths() -> dict[str, Any]:
    """vLLM's rerank, at its three paths."""
    return {
        p: embedding(
            "vLLM's rerank (Jina's and Cohere's API) by embeddings",
            "RerankRequest",
            "results: the documents best first, each with its index and relevance_score",
        )
        for p in ("/rerank", "/v1/rerank", "/v2/rerank")
    }
