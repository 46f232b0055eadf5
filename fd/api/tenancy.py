"""API keys as tenants: who may call the API node, and which requests each caller may see.

Each ``--api-key`` is a tenant. A request made with one carries its *tag* (``tenant=`` on its
``accepted`` events: a hash of the key, never the key), so any replica can tell whose it is.
A tenant sees only its own requests: asked for any other id, every per-request route answers
exactly as for an id that never existed, so the answer does not tell whether it exists.

Ids a tenant gives (``X-Request-Id``) live in a space of its own: the event log names them
``<tag>:<id>`` (:meth:`Caller.own`), so two tenants may use the same id, and the 409 of a
reused id only ever speaks of the tenant's own. Ids the server makes are random (128 bits),
the same in the log as in the answer, and found by their tag.

The admin key (``--admin-key``) sees every request under its id in the event log, as the
operators' tools do. A server with one API key and no admin key has one tenant, whose key is
then the admin's: its ids are the log's, as on a server without keys. With no key at all the
server is open and every caller sees everything.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fd.control.bus import Bus
from fd.control.events import Accepted
from fd.control.keys import valid_request_id

TAG_HEX = 16  # 64 bits of SHA-256: tells a handful of keys apart, says nothing of any
TENANT_ID_MAX = 128 - TAG_HEX - 1  # the longest id a tenant may give: `<tag>:<id>` is an id too


def key_tag(key: str) -> str:
    """A tenant's tag: one-way, and the same on every replica given the same key. Keys are
    secrets of high entropy (``openssl rand -hex 32``), so an unkeyed hash does not open
    them to a guess; the domain string keeps the tag from being any other use's hash."""
    return hashlib.sha256(b"fd.tenant\0" + key.encode()).hexdigest()[:TAG_HEX]


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent one HTTP request. ``tag`` None: ids are the event log's as they are (the
    admin, a lone key, anyone on a server with no API key); otherwise a tenant, seeing only
    its own requests.
    ``admin``: may act on everyone's (abort all, LoRA adapters)."""

    tag: str | None
    admin: bool

    def own(self, given: str) -> str | None:
        """The log's id of an id this caller gives; None when namespacing makes it longer than
        an id may be."""
        if self.tag is None:
            return given
        rid = f"{self.tag}:{given}"
        return rid if valid_request_id(rid) else None

    def owns(self, first: object) -> bool:
        """Whether a story that begins with ``first`` is this caller's to see."""
        return self.tag is None or (isinstance(first, Accepted) and first.tenant == self.tag)

    @property
    def may_abort(self) -> bool:
        """Abort and cancel by id: the admin, or a tenant (its own requests only). An anonymous
        caller of a server that has only an admin key may not."""
        return self.admin or self.tag is not None


class Tenancy:
    """The keys a server takes: ``api_keys`` (each a tenant) and ``admin_key``."""

    def __init__(self, api_keys: Sequence[str] = (), admin_key: str | None = None):
        self._admin = admin_key.encode() if admin_key else None
        keys = list(dict.fromkeys(k for k in api_keys if k))
        self._keys = [(k.encode(), key_tag(k)) for k in keys]
        # one key and no admin key: one tenant, who is the admin (a single-key server's ids
        # are the log's, as before keys had tenants)
        self._sole = len(self._keys) == 1 and self._admin is None

    @classmethod
    def of(cls, api_key: str | Iterable[str] | None, admin_key: str | None) -> Tenancy:
        """From ``ApiConfig``'s fields: one key as a string, several as a list."""
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        return cls(keys, admin_key)

    @property
    def keyed(self) -> bool:
        """Whether ``/v1`` needs an API key at all."""
        return bool(self._keys)

    def caller(self, token: str | None) -> Caller | None:
        """The caller a bearer token makes, or None for a refused one. Every key is compared,
        each in constant time, so the time taken does not say which one matched."""
        given = token.encode() if token is not None else None
        admin = given is not None and self._admin is not None and hmac.compare_digest(given, self._admin)
        tag = None
        for key, t in self._keys:
            if given is not None and hmac.compare_digest(given, key):
                tag = t
        if admin or (tag is not None and self._sole):
            return Caller(None, True)
        if tag is not None:
            return Caller(tag, False)
        if self._keys:
            return None
        # no API key: /v1 is open; the admin key, if any, is only needed to act on all
        return Caller(None, self._admin is None)


async def story(bus: Bus, caller: Caller, rid: str) -> tuple[str | None, list]:
    """The log's id of the request a caller names ``rid``, and its story; for an id that is not
    the caller's, an empty story and the id an unknown ``rid`` has in the caller's own space
    (where an abort lays its tombstone), so that the two cannot be told apart."""
    mine = caller.own(rid)
    if caller.tag is None:
        return mine, await bus.read_req(rid, b"0")
    if mine is not None:
        history = await bus.read_req(mine, b"0")
        if history:  # (only this tenant makes ids in its space)
            return mine, history
    history = await bus.read_req(rid, b"0")
    if history and caller.owns(history[0][1]):
        return rid, history
    return mine, []


async def abort_targets(bus: Bus, caller: Caller, ids: Sequence[str]) -> list[str | None]:
    """The log's ids an abort of ``ids`` by this caller is for, in order: each its own
    request's, or where an unknown id would be (None: nowhere, an id too long to be one)."""
    if caller.tag is None:
        return list(ids)
    mine = [caller.own(r) for r in ids]
    spaced = [m for m in mine if m is not None]
    firsts = await bus.first_events(spaced + list(ids))
    in_space = dict(zip(spaced, firsts, strict=False))
    out: list[str | None] = []
    for rid, m, first in zip(ids, mine, firsts[len(spaced) :], strict=False):
        if m is not None and in_space[m] is not None:
            out.append(m)
        elif caller.owns(first):
            out.append(rid)
        else:
            out.append(m)
    return out
