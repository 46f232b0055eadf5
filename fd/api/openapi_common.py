"""The pieces every part of the OpenAPI document (:mod:`fd.api.openapi`) is built of: schema
references, nullable scalars, token ids, the error answer and the request-id parameters."""

from __future__ import annotations

from typing import Any

from fd.control.keys import REQUEST_ID_RE

REQUEST_ID_PATTERN = REQUEST_ID_RE.pattern  # ECMA-262 as JSON Schema wants: "$" is the very end there


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


NULLABLE_BOOL = {"type": "boolean", "nullable": True}
INT_OR_NULL = {
    "type": "integer",
    "format": "int64",
    "nullable": True,
}  # JSON ints past 64 bits are not ints to orjson


def token_id(vocab_size: int | None) -> dict[str, Any]:
    """A token id: one of the vocabulary's, where its size is known."""
    schema: dict[str, Any] = {"type": "integer", "format": "int64", "minimum": 0}
    if vocab_size:
        schema["maximum"] = vocab_size - 1
    return schema


def error() -> dict[str, Any]:
    """OpenAI's error answer, the shape of every 4xx."""
    return {
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
    }


def err(desc: str) -> dict:
    return {"description": desc, "content": {"application/json": {"schema": ref("Error")}}}


ERRORS = {
    "400": err("Invalid request"),
    "401": err("Missing or wrong key"),
    "413": err("Body larger than the limit"),
}
RID_HEADER = {
    "name": "X-Request-Id",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "pattern": REQUEST_ID_PATTERN, "maxLength": 128},
}
RID_PATH = {
    "name": "id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": REQUEST_ID_PATTERN, "maxLength": 128},
}
