"""The ``POST /v1/abort_requests`` body: which requests (or all of them, of one engine or
every engine) a caller asks to abort."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fd.api.errors import ApiError, bad_request


@dataclass(frozen=True, slots=True)
class AbortBody:
    """A parsed ``POST /v1/abort_requests`` body."""

    request_ids: tuple[str, ...] = ()
    rejected: tuple[tuple[str, str], ...] = ()  # (request_id, reason)
    abort_all: bool = False
    engine: str | None = None


def parse_abort(body: Any, valid_request_id, valid_engine_id, max_ids: int, all_valid=None) -> AbortBody:
    """FastDeploy's ``req_ids``, vLLM's ``request_ids``, or ``abort_all``; both shapes live on,
    because changing this body under existing clients is exactly what must not happen."""
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    engine = body.get("engine")
    if engine is not None and (not isinstance(engine, str) or not valid_engine_id(engine)):
        raise bad_request("'engine' must be a valid engine id.", "engine", "invalid_value")
    if body.get("abort_all") is not None:
        if not isinstance(body["abort_all"], bool):
            raise bad_request("'abort_all' must be a boolean.", "abort_all", "invalid_type")
        if body["abort_all"]:
            return AbortBody(abort_all=True, engine=engine)
    ids = None
    for name in ("req_ids", "request_ids"):
        if body.get(name) is not None:
            ids, param = body[name], name
            break
    if ids is None:
        raise bad_request(
            "Give 'req_ids' (or 'request_ids') as a list of request ids, or 'abort_all': true.",
            "req_ids",
            "missing_required_parameter",
        )
    if isinstance(ids, str):
        ids = [ids]
    if not isinstance(ids, list):
        raise bad_request(f"'{param}' must be a list of request ids.", param, "invalid_type")
    if len(ids) > max_ids:
        raise bad_request(f"At most {max_ids} request ids per call.", param, "invalid_value")
    if all_valid is not None and all_valid(ids):
        return AbortBody(tuple(dict.fromkeys(ids)), (), False, engine)
    accepted: dict[str, None] = {}
    rejected = []
    for rid in ids:
        if not isinstance(rid, str):
            rejected.append((str(rid)[:128], "not a string"))
        elif not valid_request_id(rid):
            rejected.append((rid[:128], "invalid request id (letters, digits, '_.:@-', 1-128 chars)"))
        else:
            accepted.setdefault(rid)
    if not accepted:
        raise ApiError(400, "No valid request ids given.", "invalid_request_error", param, "invalid_value")
    return AbortBody(tuple(accepted), tuple(rejected), False, engine)
