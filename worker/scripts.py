"""The Lua scripts the worker runs in Redis: each makes one decision atomically.

Publishing and keeping leases are checks-then-writes that must not interleave with
another worker's: a worker that was cut off while another took over its requests, or
a pipeline retried after a dropped connection, must never write an event twice.
They touch the request stream and per-request keys in one call, so on a Redis Cluster
they would need every key in one slot (a later step; one Redis serves the fleet today).
Every per-request read and write is guarded: whatever a request's keys hold, the
script answers for that request alone.
"""

from __future__ import annotations

# Per request and step: XPENDING, HMGET, XADD per event, HSET; TTL refreshes only now
# and then.
# KEYS: per request, its request stream, reply stream, progress hash and done key.
# ARGV: group, consumer, result_ttl_s, dedupe_ttl_s; then per request: entry id, the
#   position of its first event, 1 if its last event is terminal, the event count, and
#   type / encoding / body for each event.
# One status per request:
#   applied    written (or already written by an earlier try of this same call)
#   lost       another consumer owns the entry now, or it is no longer pending: write nothing
#   duplicate  another entry with the same request id writes this output
#   gap:<n>    the stream holds <n> events, not the position given (output lost in Redis)
#   refused:<e> Redis refused this request's keys (say, a reply stream of another type):
#              nothing written, the entry left pending for the worker to answer elsewhere
# A request's failure stays its own (pcall), except the replies that pass (OOM before
# the call's first write, READONLY, ...): those fail the whole call, which wrote nothing
# yet, so that the worker retries it.
PUBLISH = """
local group, consumer = ARGV[1], ARGV[2]
local result_ttl, dedupe_ttl = ARGV[3], ARGV[4]
local passing = {OOM = true, READONLY = true, BUSY = true, LOADING = true, MASTERDOWN = true,
                 TRYAGAIN = true, CLUSTERDOWN = true}

local function publish_one(stream, reply, progress, done, entry, first, terminal, events, last)
  local owner = redis.pcall('XPENDING', stream, group, entry, entry, 1)
  local mine = type(owner) == 'table' and not owner.err and #owner == 1 and owner[1][2] == consumer
  if not mine then
    local done_by = redis.call('GET', done)
    if done_by and done_by ~= entry then return 'duplicate' end
    return done_by and 'applied' or 'lost'  -- applied: a retry of the call that finished it
  end
  local fence = redis.call('HMGET', progress, 'entry', 'next')
  local written = tonumber(fence[2] or '0')
  if fence[1] and fence[1] ~= entry then return 'duplicate' end
  if written == first + (last - events + 1) / 3 then return 'applied' end  -- a retry of this very call
  if written ~= first then return 'gap:' .. written end
  for i = events, last, 3 do
    redis.call('XADD', reply, '*', 'type', ARGV[i], ARGV[i + 1], ARGV[i + 2])
  end
  local count = (last - events + 1) / 3
  redis.call('HSET', progress, 'entry', entry, 'next', first + count)
  -- TTLs are refreshed at the first write, at the last, and every 32 events between.
  if first == 0 or terminal or math.floor(first / 32) ~= math.floor((first + count) / 32) then
    redis.call('EXPIRE', reply, result_ttl)
    redis.call('EXPIRE', progress, result_ttl)
  end
  if terminal then
    redis.call('SET', done, entry, 'EX', dedupe_ttl)
    redis.call('XACK', stream, group, entry)
    redis.call('XDEL', stream, entry)
  end
  return 'applied'
end

local statuses = {}
local arg = 5
for k = 1, #KEYS, 4 do
  local entry, first = ARGV[arg], tonumber(ARGV[arg + 1])
  local terminal, count = ARGV[arg + 2] == '1', tonumber(ARGV[arg + 3])
  local events = arg + 4
  arg = events + 3 * count
  local ok, status = pcall(publish_one, KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], entry, first, terminal,
                           events, arg - 1)
  if not ok then
    local message = type(status) == 'table' and status.err or tostring(status)
    if passing[string.match(message, '^(%u+)')] then return redis.error_reply(message) end
    status = 'refused:' .. message
  end
  statuses[#statuses + 1] = status
end
return statuses
"""

# KEYS[1] request stream, KEYS[2] this worker's heartbeat key.
# ARGV: group, consumer, heartbeat value ('' deletes it), its TTL in ms, the idle time to
#   give our entries in ms (0 keeps them fresh; a large value hands them back), this
#   worker's instance token (in its heartbeat), entry ids.
# Allowed when Redis is out of memory: it writes a few bytes, and leases that lapsed would
# make the fleet take over each other's requests, which writes far more.
# Fails with NAMETAKEN if the heartbeat is another worker's. Claims (JUSTID: the delivery
# count stays) only the entries this consumer still owns, and returns the ids it no
# longer owns: another worker took them over.
KEEP_MINE = """#!lua flags=allow-oom
local group, consumer = ARGV[1], ARGV[2]
local current = redis.call('GET', KEYS[2])
if current and not string.find(current, ARGV[6], 1, true) then
  return redis.error_reply('NAMETAKEN another worker holds the consumer name ' .. consumer .. ': ' .. current)
end
if ARGV[3] == '' then
  redis.call('DEL', KEYS[2])
else
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
end
local mine, lost = {}, {}
for i = 7, #ARGV do
  local owner = redis.pcall('XPENDING', KEYS[1], group, ARGV[i], ARGV[i], 1)
  if type(owner) == 'table' and not owner.err and #owner == 1 and owner[1][2] == consumer then
    mine[#mine + 1] = ARGV[i]
  else
    lost[#lost + 1] = ARGV[i]
  end
end
if #mine > 0 then
  redis.call('XCLAIM', KEYS[1], group, consumer, 0, unpack(mine), 'IDLE', ARGV[5], 'JUSTID')
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

# KEYS[1] request stream, KEYS[2] the consumer's heartbeat key. ARGV: group, consumer.
# Deletes a consumer that left, only if it is still silent and owns nothing: deleting a
# consumer makes its pending entries unclaimable.
FORGET_CONSUMER = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #pending > 0 then return 0 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2]) + 1
"""
