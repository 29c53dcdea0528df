"""The Lua scripts the worker runs in Redis: each makes one decision atomically.

Publishing is a check-then-write that must not interleave with another worker's: a
worker that was cut off while another took over its requests, or a call retried after a
dropped connection, must never write an event twice. Each request has a fence (see
`Keys.progress`) in the slot of the stream it writes: the entry that writes its output,
the token of the taking that may write now, and how many events are written. A worker
takes the fence (a new token) when it starts serving an entry; the publish script
writes only under the token it holds. No script touches two slots, so every script
runs on a Redis Cluster as on one server. Every per-request read and write is guarded:
whatever a request's keys hold, the script answers for that request alone.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

# KEYS[1] a request's fence. ARGV: entry id, a new token, the consumer, the fence's TTL in s.
# Returns {status, events written, 1 if the terminal event is written}; status is
#   taken      the token is the fence's now: writes under any earlier token are refused
#   duplicate  another entry with the same request id writes this output
TAKE = """
local fence = redis.call('HMGET', KEYS[1], 'entry', 'next', 'finished')
if fence[1] and fence[1] ~= ARGV[1] then return {'duplicate', 0, 0} end
redis.call('HSET', KEYS[1], 'entry', ARGV[1], 'token', ARGV[2], 'owner', ARGV[3], 'next', fence[2] or 0)
redis.call('EXPIRE', KEYS[1], ARGV[4])
return {'taken', tonumber(fence[2] or '0'), fence[3] and 1 or 0}
"""

# KEYS: a request's attempts set, done mark and cancel flag (one slot). ARGV: a new
# attempt, the attempts' TTL in s, the TTL a cancel flag set without one gets.
# Opens the attempt; returns {open attempts (ours included), 1 if done, 1 if cancelled}.
# One call rather than a pipeline of six: each command a pipeline packs costs the
# worker's event loop more than the script costs Redis.
ARRIVE = """
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
local cancelled = redis.call('EXISTS', KEYS[3])
redis.call('EXPIRE', KEYS[3], ARGV[3], 'NX')
return {redis.call('SCARD', KEYS[1]), redis.call('EXISTS', KEYS[2]), cancelled}
"""

# Per request and step: HMGET, XADD per event, HSET; TTLs refreshed only now and then.
# KEYS: per request, the stream it writes and its fence (one slot).
# ARGV: result_ttl_s, then every request's write as one msgpack array (one argument,
#   unpacked here: packing a step's hundreds of arguments one by one cost the worker
#   more than the step), each [entry id, fence token, position of its first event,
#   true if its last event is terminal, encoding, {type, body, type, body, ...}].
# Returns one status per request, msgpack-packed:
#   applied    written (or already written by an earlier try of this same call)
#   lost       another taking holds the fence now: write nothing
#   duplicate  another entry with the same request id writes this output
#   expired    the fence is gone (it outlived result_ttl_s without a write): nothing written
#   gap:<n>    the stream holds <n> events, not the position given (output lost in Redis)
#   refused:<e> Redis refused this request's keys (say, a reply stream of another type):
#              nothing written, the entry left pending for the worker to answer elsewhere
# A request's failure stays its own (pcall), except the replies that pass (OOM before
# the call's first write, READONLY, ...): those fail the whole call, which wrote nothing
# yet, so that the worker retries it.
PUBLISH = """
local result_ttl = ARGV[1]
local passing = {OOM = true, READONLY = true, BUSY = true, LOADING = true, MASTERDOWN = true,
                 TRYAGAIN = true, CLUSTERDOWN = true}

local function publish_one(reply, progress, write)
  local entry, token, first, terminal, encoding, events = write[1], write[2], write[3], write[4], write[5], write[6]
  local fence = redis.call('HMGET', progress, 'entry', 'next', 'token')
  if not fence[1] then return 'expired' end
  if fence[1] ~= entry then return 'duplicate' end
  if fence[3] ~= token then return 'lost' end
  local written = tonumber(fence[2] or '0')
  local count = #events / 2
  if written == first + count then return 'applied' end  -- a retry of this very call
  if written ~= first then return 'gap:' .. written end
  for i = 1, #events, 2 do
    redis.call('XADD', reply, '*', 'type', events[i], encoding, events[i + 1])
  end
  redis.call('HSET', progress, 'next', first + count)
  if terminal then redis.call('HSET', progress, 'finished', 1) end
  -- TTLs are refreshed at the first write, at the last, and every 32 events between.
  if first == 0 or terminal or math.floor(first / 32) ~= math.floor((first + count) / 32) then
    redis.call('EXPIRE', reply, result_ttl)
    redis.call('EXPIRE', progress, result_ttl)
  end
  return 'applied'
end

local writes = cmsgpack.unpack(ARGV[2])
local statuses = {}
for k = 1, #writes do
  local ok, status = pcall(publish_one, KEYS[2 * k - 1], KEYS[2 * k], writes[k])
  if not ok then
    local message = type(status) == 'table' and status.err or tostring(status)
    if passing[string.match(message, '^(%u+)')] then return redis.error_reply(message) end
    status = 'refused:' .. message
  end
  statuses[k] = status
end
return cmsgpack.pack(statuses)
"""

# KEYS[1] this worker's heartbeat key. ARGV: the heartbeat ('' deletes it), its TTL in
# ms, this worker's instance token (in its heartbeat).
# Allowed when Redis is out of memory: it writes a few bytes, and leases that lapsed would
# make the fleet take over each other's requests, which writes far more.
# Fails with NAMETAKEN if the heartbeat is another worker's.
HEARTBEAT = """#!lua flags=allow-oom
local current = redis.call('GET', KEYS[1])
if current and not string.find(current, ARGV[3], 1, true) then
  return redis.error_reply('NAMETAKEN another worker holds this consumer name (' .. KEYS[1] .. '): ' .. current)
end
if ARGV[1] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
return 1
"""

# KEYS[1] a request stream. ARGV: group, consumer, the idle time to give our entries in ms
# (0 keeps them fresh; a large value hands them back), entry ids.
# Claims (JUSTID: the delivery count stays) only the entries this consumer still owns, and
# returns the ids it no longer owns: another worker took them over. Allowed when out of
# memory, as the heartbeat.
KEEP_MINE = """#!lua flags=allow-oom
local group, consumer = ARGV[1], ARGV[2]
local mine, lost = {}, {}
for i = 4, #ARGV do
  local owner = redis.pcall('XPENDING', KEYS[1], group, ARGV[i], ARGV[i], 1)
  if type(owner) == 'table' and not owner.err and #owner == 1 and owner[1][2] == consumer then
    mine[#mine + 1] = ARGV[i]
  else
    lost[#lost + 1] = ARGV[i]
  end
end
if #mine > 0 then
  redis.call('XCLAIM', KEYS[1], group, consumer, 0, unpack(mine), 'IDLE', ARGV[3], 'JUSTID')
end
return lost
"""

# KEYS[1] a consumer name's heartbeat key. ARGV: our heartbeat, its TTL in ms, and the
# heartbeat we may replace ('' for none: a dead process's, seen by the caller).
# Returns 1 when the name is ours now, else the heartbeat of the worker that holds it.
CLAIM_NAME = """
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[3] then return current end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS[1] request stream. ARGV: group, consumer (one whose heartbeat the caller saw gone).
# Deletes a consumer that left, only if it owns nothing: deleting a consumer makes its
# pending entries unclaimable. (Should it come back, its next read makes it anew.)
FORGET_CONSUMER = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #pending > 0 then return 0 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2]) + 1
"""


@functools.cache
def _sha1(script: str) -> str:
    """The hash Redis knows a script by (computed once: the publish script runs every step)."""
    return hashlib.sha1(script.encode()).hexdigest()


class ScriptRunner:
    """Runs Lua scripts by hash, loading one when Redis does not have it (after a restart)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    async def run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        sha = _sha1(script)
        try:
            return await self.redis.evalsha(sha, len(keys), *keys, *args)  # type: ignore[misc]
        except NoScriptError:
            await self.redis.script_load(script)
            return await self.redis.evalsha(sha, len(keys), *keys, *args)  # type: ignore[misc]

    async def run_many(self, script: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """One call of `script` per (keys, args), pipelined (on a cluster, grouped by node);
        the script is loaded once if a node lacks it, and every call sent again: each is a
        no-op where it already ran (see `PUBLISH`)."""
        if len(calls) == 1:
            return [await self.run(script, *calls[0])]
        try:
            return await self._pipelined(_sha1(script), calls)
        except NoScriptError:
            await self.redis.script_load(script)
            return await self._pipelined(_sha1(script), calls)

    async def _pipelined(self, sha: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                # execute_command: a cluster pipeline refuses its evalsha() method
                pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
            return await pipe.execute()  # type: ignore[no-any-return]
