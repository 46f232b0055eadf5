"""The OpenAPI document's routes on requests in flight: aborts (by id, or all), a request's
stream replayed or resumed, and the LoRA adapters loaded at run time."""

from __future__ import annotations

from typing import Any

from fd.api.openapi_common import ERRORS, REQUEST_ID_PATTERN, RID_PATH, err, ref


def abort_request() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "One of req_ids (FastDeploy), request_ids (vLLM) or abort_all.",
        "properties": {
            "req_ids": {"type": "array", "items": {"type": "string", "pattern": REQUEST_ID_PATTERN}},
            "request_ids": {"type": "array", "items": {"type": "string", "pattern": REQUEST_ID_PATTERN}},
            "abort_all": {"type": "boolean"},
            "engine": {"type": "string", "description": "with abort_all: only this engine"},
        },
    }


def abort_response() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "abort_id": {"type": "string"},
            "accepted": {"type": "array", "items": {"type": "string"}},
            "rejected": {"type": "array", "items": {"type": "object"}},
            "abort_all": {"type": "boolean"},
        },
    }


def abort_requests(security: list[dict[str, list]]) -> dict[str, Any]:
    """``POST /v1/abort_requests``"""
    return {
        "post": {
            "summary": "Abort requests by id (a tenant: its own), or all (the admin key); answers at once",
            "security": security,
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
                "content": {"application/json": {"schema": ref("AbortRequest")}},
            },
            "responses": {
                "200": {
                    "description": "Abort published",
                    "content": {"application/json": {"schema": ref("AbortResponse")}},
                },
                **ERRORS,
            },
        }
    }


def request_stream() -> dict[str, Any]:
    """``GET /v1/requests/{id}/stream``"""
    return {
        "get": {
            "summary": "Replay / resume a request's SSE stream (Last-Event-ID)",
            "security": [{"apiKey": []}],
            "parameters": [
                RID_PATH,
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
                "400": ERRORS["400"],
                "401": ERRORS["401"],
                "404": err("Unknown or expired request"),
            },
        }
    }


def lifecycle(security: list[dict[str, list]]) -> dict[str, Any]:
    """``GET /v1/lifecycle`` (DESIGN.md §2, ``P:lifecycle``)"""
    return {
        "get": {
            "summary": "The lifecycle stream as server-sent events: request milestones, engine loads",
            "security": security,
            "parameters": [
                {"name": "Last-Event-ID", "in": "header", "required": False, "schema": {"type": "string"}},
                {
                    "name": "since",
                    "in": "query",
                    "required": False,
                    "description": "an entry id to go on after (0: from the oldest kept; default: only new)",
                    "schema": {"type": "string"},
                },
            ],
            "responses": {
                "200": {
                    "description": "SSE stream: id = entry id, event = type, data = the entry's fields",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}},
                },
                "400": ERRORS["400"],
                "401": ERRORS["401"],
                "503": err("Redis is not answering"),
            },
        }
    }


def request_cancel(security: list[dict[str, list]]) -> dict[str, Any]:
    """``POST /v1/requests/{id}/cancel``"""
    return {
        "post": {
            "summary": "Abort one request; answers at once",
            "security": security,
            "parameters": [RID_PATH],
            "responses": {
                "200": {
                    "description": "Abort published",
                    "content": {"application/json": {"schema": ref("AbortResponse")}},
                },
                "400": ERRORS["400"],
                "401": ERRORS["401"],
            },
        }
    }


def lora_paths(security: list[dict[str, list]]) -> dict[str, Any]:
    """vLLM's routes that load and unload adapters on every engine."""
    return {
        path: {
            "post": {
                "summary": summary,
                "security": security,
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": required,
                                "properties": {
                                    k: {"type": "string"} for k in ("lora_name", "lora_path")[: len(required)]
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
                    "400": ERRORS["400"],
                    "401": ERRORS["401"],
                    "404": err("No such adapter"),
                    "503": err("Not every engine loaded it in time"),
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
