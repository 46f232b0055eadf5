"""Starting a request's story exactly once.

A story's first entry is its ``accepted`` (or, when an abort overtook the request, the whole
abort story after it). The API writes it together with the request's ``P:requests`` entry,
and on a lost connection redis-py sends the same commands again: a first try that landed but
whose reply was lost (a killed connection) would then be written twice, and the second
``accepted`` could land after the request had already run to its final. So the start is one
script (:data:`SCRIPT`) that writes only into a story that has no entry yet:

- an empty story gets the events, its TTL and (on a single Redis) the ``P:requests`` entry;
- a story whose first entry is, field for field, the first event being written is this very
  start sent again: nothing is written, and the caller goes on as if it had been (``DONE``);
- any other first entry is another request's story under the same id: nothing is written
  (``TAKEN``; the API answers 409, as for an id it found taken before submitting).

On a Redis Cluster ``P:requests`` lives in another slot than the story, so the script writes
the story only and the caller appends the request afterwards; a resent append of that entry
gives an engine a second entry of a request it already owns, which the claim drops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fd.control.fence import ScriptArgs, append_fields

#: KEYS: the story, then (a single Redis only) ``P:requests`` or the lane the request is
#: placed on, then (with a lane) the lanes' registry (fd/control/lanes.py).
#: ARGV: ttl (seconds; 0: none), the request stream's MAXLEN (0: none), the number of story
#: events, then per event its number of field strings and the strings (name, value, ...), then
#: (with the second key) the request's, the same way, then (with the third) the lane's engine.
#: Reply: 1 written, 2 already written by this start, 0 the id's story is another's.
SCRIPT = """
local function same(f, at)
  local n = tonumber(ARGV[at])
  if #f ~= n then return false end
  for i = 1, n do
    if f[i] ~= ARGV[at + i] then return false end
  end
  return true
end
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
if first then
  if same(first[2], 4) then return 2 end
  return 0
end
local at = 4
for _ = 1, tonumber(ARGV[3]) do
  local n = tonumber(ARGV[at])
  redis.call('XADD', KEYS[1], '*', unpack(ARGV, at + 1, at + n))
  at = at + n + 1
end
if tonumber(ARGV[1]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
if KEYS[2] then
  local n = tonumber(ARGV[at])
  if tonumber(ARGV[2]) > 0 then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, at + 1, at + n))
  else
    redis.call('XADD', KEYS[2], '*', unpack(ARGV, at + 1, at + n))
  end
  if KEYS[3] then redis.call('SADD', KEYS[3], ARGV[at + n + 1]) end
end
return 1
"""

TAKEN, WRITTEN, DONE = 0, 1, 2


def script_args(
    ttl_s: int,
    story: Sequence[Mapping[str, str]],
    request: Mapping[str, str] | None = None,
    maxlen: int | None = None,
    member: str | None = None,
) -> ScriptArgs:
    """ARGV of :data:`SCRIPT`: the story's encoded events, in order, the request's, and the
    registry's new ``member`` (a lane's engine)."""
    args: ScriptArgs = [str(ttl_s), str(maxlen or 0), str(len(story))]
    for fields in story:
        append_fields(args, fields)
    if request is not None:
        append_fields(args, request)
    if member is not None:
        args.append(member)
    return args


class IdTaken(Exception):
    """The id's story is another request's: nothing was written."""

    def __init__(self, request_id: str):
        super().__init__(f"request id {request_id!r} is taken")
        self.request_id = request_id
