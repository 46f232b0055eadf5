"""The fence: an engine appends to a request's story only while it still owns the request.

Ownership is ``P:owner:{<id>}`` holding the engine's *owner token*, ``<engine>#<attempt>``
(:func:`fd.control.keys.owner_token`). A token names one grant of ownership: every claim,
takeover or resume of a request gets an attempt greater than that of any grant before it, so
an engine that was thought dead (a long pause, a partition) holds a token nobody holds any
more, even when the request went back to the same engine id (a restarted process under the
same ``--engine-id``, or the engine itself winning it again).

Each batch of a step's events for one request is appended by one script (:data:`SCRIPT`),
which checks and writes atomically, and refuses the whole batch — nothing appended — when

- the owner key holds anything but the writer's token (taken over, handed back, expired, a
  tombstone), or
- the story's last entry is a ``final``: nothing follows a final, whoever writes. This is
  checked on the stream itself rather than on a mark in the owner key, because the stream is
  what readers trust: the check needs no new owner-key value that the abort path, the API and
  the failover scan would all have to learn, and it holds however the owner key came to be
  what it is (expired and re-taken, deleted by an operator, restored from a backup).

A batch that is there already is not appended again: when one of the story's last
:data:`SEEN` entries equals, field for field, the batch's last event, the batch is the resend
of one that landed, and the script answers as if it had written it. Resends happen across a
stalled or cut connection: the engine's first try timed out but sat in Redis's socket buffer,
and its retry (:mod:`fd.engine.node.outbox`, which re-reads the story's tail first) went out on a new
connection; whichever of the two Redis runs second finds the other's entries. Two different
batches never compare equal: an engine's events carry the step and the ``ts`` they were made
at, one batch a request a step.

Nothing between a writer's batches is lost unnoticed: a batch names the writer's last event
before it (``after``, field for field), and is refused (``gap``) unless that is the story's
last entry. While an engine owns a request nobody else writes to its story, so the only way
for them to differ is a Redis that lost acknowledged writes: a replica promoted before it had
them (Sentinel's asynchronous replication), an RDB restore. A stream that silently skipped
them would show its client text that no model wrote; refused, the engine ends the request with
an error instead (its final, sent with no ``after``, says why).

A final in the batch ends it (anything after it is refused too), renews the TTL of the story
and the owner key (``EXPIRE``, as the final always did) and, on a single Redis, acknowledges
and deletes the request's ``P:requests`` entry in the same call: acknowledged only once its
final is written, and never by an engine that no longer owns it (whose ack would take the
entry from the engine that runs it now, and with it the failover's way back to it). On a Redis
Cluster the script touches only the request's two keys, which share the hash tag ``{<id>}``:
one slot, so the same script runs there too, one call per request, pipelined, and the ack
follows in a second round trip, for the requests whose final got through. The embedded server
(fakeredis, with ``lupa``) runs the same script. :meth:`fd.control.store.RedisStore.fenced_append`
sends it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

#: How many of the story's last entries a batch is looked for among (see the module's docstring).
SEEN = 4

#: KEYS: owner key, story, then (a single Redis only, where a script may name keys of any
#: slot) ``P:requests`` and more keys to renew with the final (a choice's parent's).
#: ARGV: token, ttl (seconds; 0: none), the ``P:requests`` entry to acknowledge and delete
#: with the final ("" for none), the consumer group, the number of events, the writer's last
#: event before this batch (its number of field strings, 0 for none to check, then the
#: strings), then per event its number of field strings and the strings (name, value, ...;
#: ``type`` first).
#: Reply: ``{1, id, ...}`` (the ids appended; none when the batch was there already), or
#: ``{0, why, owner}`` with nothing written, ``why`` "owner", "final" or "gap", ``owner`` the
#: owner key's value (false when absent).
_SCRIPT = """
local owner = redis.call('GET', KEYS[1])
if owner ~= ARGV[1] then return {0, 'owner', owner} end
local tail = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', SEEN)
local first = 7 + tonumber(ARGV[6])
local mine = first
local at = first
for _ = 1, tonumber(ARGV[5]) do
  mine = at
  if ARGV[at + 1] == 'type' and ARGV[at + 2] == 'final' then break end
  at = at + tonumber(ARGV[at]) + 1
end
for _, entry in ipairs(tail) do
  local f, n = entry[2], tonumber(ARGV[mine])
  if #f == n then
    local same = true
    for i = 1, n do
      if f[i] ~= ARGV[mine + i] then same = false break end
    end
    if same then return {1} end
  end
end
local last = tail[1]
if last then
  local f = last[2]
  for i = 1, #f, 2 do
    if f[i] == 'type' then
      if f[i + 1] == 'final' then return {0, 'final', owner} end
      break
    end
  end
end
local n = tonumber(ARGV[6])
if n > 0 then
  local same = last ~= nil and #last[2] == n
  if same then
    for i = 1, n do
      if last[2][i] ~= ARGV[6 + i] then same = false break end
    end
  end
  if not same then return {0, 'gap', owner} end
end
local out = {1}
local at = first
local ended = false
for _ = 1, tonumber(ARGV[5]) do
  local n = tonumber(ARGV[at])
  out[#out + 1] = redis.call('XADD', KEYS[2], '*', unpack(ARGV, at + 1, at + n))
  if ARGV[at + 1] == 'type' and ARGV[at + 2] == 'final' then
    ended = true
    break
  end
  at = at + n + 1
end
if ended then
  local ttl = tonumber(ARGV[2])
  if ttl > 0 then
    redis.call('EXPIRE', KEYS[2], ttl)
    redis.call('EXPIRE', KEYS[1], ttl)
    for k = 4, #KEYS do redis.call('EXPIRE', KEYS[k], ttl) end
  end
  if ARGV[3] ~= '' then
    redis.call('XACK', KEYS[3], ARGV[4], ARGV[3])
    redis.call('XDEL', KEYS[3], ARGV[3])
  end
end
return out
"""
SCRIPT = _SCRIPT.replace("SEEN", str(SEEN))

#: A script's ARGV as redis-py sends it: strings, and an acked entry's id as its bytes.
ScriptArgs: TypeAlias = list[str | bytes]


@dataclass(frozen=True, slots=True)
class Refused:
    """A batch the fence turned away; nothing of it was appended."""

    why: str  # "owner": the owner key holds ``owner``, not the token; "final": the story ended;
    # "gap": the story's last entry is not the writer's last (a failover lost what it wrote);
    # "error": Redis refused the script for a reason of the request's own (``error``: its
    # reply; a key of the request's overwritten with another type, say: fd/control/outage.py)
    owner: str | None
    error: str | None = None


def append_fields(args: ScriptArgs, fields: Mapping[str, str]) -> None:
    """One event as the stories' scripts take it in ARGV: its number of field strings, then
    the strings (name, value, ...)."""
    args.append(str(2 * len(fields)))
    for k, v in fields.items():
        args.append(k)
        args.append(v)


def script_args(
    token: str,
    ttl_s: int,
    fields: Sequence[Mapping[str, str]],
    ack: bytes | None = None,
    group: str = "",
    after: Mapping[str, str] | None = None,
) -> ScriptArgs:
    """ARGV of :data:`SCRIPT` for one request's events (their encoded fields, in order);
    ``after``: the writer's last event on the story before them, which must be its last entry."""
    args: ScriptArgs = [token, str(ttl_s), ack or b"", group, str(len(fields))]
    append_fields(args, after or {})
    for f in fields:
        append_fields(args, f)
    return args


def script_result(reply: Sequence[Any]) -> list[bytes] | Refused:
    """The script's reply as :meth:`fd.control.bus.Bus.publish_owned` hands it on."""
    if int(reply[0]) == 1:
        return [r if isinstance(r, bytes) else str(r).encode() for r in reply[1:]]
    why = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
    owner = reply[2] if len(reply) > 2 else None
    return Refused(why, owner.decode() if isinstance(owner, bytes) else owner or None)
