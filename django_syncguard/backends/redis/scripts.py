"""The Lua scripts of the Redis backend, one per operation (``specs/backends/redis.md``).

Each script runs atomically on the server and reads the server's clock, so one
operation is one round trip and client clocks never matter. The header of each
states its KEYS and ARGV (Lua arrays count from 1) and what it returns; the lock
hash's fields are described in :mod:`.backend`. The scripts are plain strings: the
client layer (:mod:`.client`) registers them on each client it builds.
"""

from __future__ import annotations

# Fragment, first in every script: ``now`` = the Redis server's clock (TIME), in
# whole Unix milliseconds. Reads no KEYS or ARGV.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Fragment: the queue helpers (functions of the hash name they are given; they read
# no KEYS or ARGV themselves). The queue of waiters lives in the lock hash itself
# (same key, same slot): fields 'w:<ticket id>' = '<arrival> <live until ms>',
# 's:<ticket id>' = when that ticket was queued (ms; for the inspector's oldest wait,
# written once, beside 'w:'; a separate field so that scripts of versions before it,
# which parse 'w:' values, keep working beside it), 'q' = how many there are (read
# with the lock fields, so an empty queue costs the hot path nothing) and 'n' = the
# last arrival number handed out, 't:<ticket id>' = what a waiter that accepts a
# grant asked for (a JSON array, see ``grant``), and 'h' = '<ticket id> <arrival>' of
# the first waiter when it was last known (the head hint, see ``wake_next``). 'q', 'n'
# and 'h' go when the queue empties. These helpers read the whole hash (HGETALL): only
# when 'q' says somebody waits, and a grant not even then while the head hint holds.
# Scripts define them inside the branch that needs them, so the path without waiters
# does not even create their closures.
_QUEUE = """
local function hdel_all(h, names)
  for j = 1, #names, 500 do
    redis.call('HDEL', h, unpack(names, j, math.min(j + 499, #names)))
  end
end
-- The queue of hash h, read in one HGETALL: {live = {ticket id = arrival}, count =
-- how many are live, head = the id of the first, first = its arrival, records =
-- {ticket id = its 't:'}, f = the fence field}. Stale waiters (live until <= now) are
-- deleted.
local function queue_load(h, now)
  local all = redis.call('HGETALL', h)
  local live, records, stale, count, head, first, f = {}, {}, {}, 0, nil, nil, nil
  for j = 1, #all, 2 do
    local name = all[j]
    local kind = string.sub(name, 1, 2)
    if kind == 'w:' then
      local value = all[j + 1]
      local space = string.find(value, ' ', 1, true)
      local arrival = tonumber(string.sub(value, 1, space - 1))
      local id = string.sub(name, 3)
      if tonumber(string.sub(value, space + 1)) > now then
        live[id] = arrival
        count = count + 1
        if first == nil or arrival < first then
          head, first = id, arrival
        end
      else
        stale[#stale + 1] = name
        stale[#stale + 1] = 's:' .. id
        stale[#stale + 1] = 't:' .. id
      end
    elseif kind == 't:' then
      records[string.sub(name, 3)] = all[j + 1]
    elseif name == 'f' then
      f = all[j + 1]
    end
  end
  hdel_all(h, stale)
  return {live = live, count = count, head = head, first = first, records = records, f = f}
end
-- The live waiter of ``live`` (queue_load's) with the smallest arrival, other than
-- ``skip``: its id and arrival (nil when there is none).
local function first_of(live, skip)
  local head, first = nil, nil
  for id, arrival in pairs(live) do
    if id ~= skip and (first == nil or arrival < first) then
      head, first = id, arrival
    end
  end
  return head, first
end
-- Record the number of waiters (only when it changed); an empty queue leaves no field.
local function queue_store(h, count, stored)
  if count == stored then
    return
  end
  if count > 0 then
    redis.call('HSET', h, 'q', count)
  else
    redis.call('HDEL', h, 'q', 'n', 'h')
  end
end
-- Hand the free key h to the waiter at the head of queue q (queue_load), in this
-- script (a grant): the lock its record 't:' asked for is written as an acquire would
-- write it, plus 'g' = the claim deadline and 'G' = the ticket. The grant is published
-- on the waiter's process channel as 'g <ticket> <lock id> <fence> <expires> <hash>'
-- (or, without one, on the key's as '<ticket> <lock id> <fence> <expires>'). Unless
-- ``watched`` (the caller's process checks the grant once its window is over, see
-- CHECK_GRANT), the next live waiter's process hears 'n <ticket> <hash>' (it re-checks
-- then itself). With ``final``, the count of waiters left ('q') is written too, in the
-- same HSET (the caller writes it otherwise). False (nothing written) when the ticket
-- left no record (a waiter of a version without grants) or the fence would pass the
-- maximum: the caller only wakes it then. The record, written by ACQUIRE: {lock id,
-- index key, floor key, ttl ms, fence mode, max fence, owner, user key, tolerance ms,
-- grant window ms, process channel or ""}, numbers as strings.
-- Every write of the hash is one HDEL and one HSET: each call a script makes costs
-- the server microseconds, several times more on a core that sat idle through a hold,
-- and a release's grant is the hand-off's critical path.
local function grant(h, now, q, watched, final)
  local head = q.head
  local record = q.records[head]
  if not record then
    return false
  end
  local r = cjson.decode(record)
  local fence = math.max(tonumber(q.f) or 0, tonumber(redis.call('GET', r[3])) or 0) + 1
  if r[5] == 'clock' then
    fence = math.max(fence, now)
  end
  if fence > tonumber(r[6]) then
    return false
  end
  local expires = now + tonumber(r[4])
  local gone = {'w:' .. head, 's:' .. head, 't:' .. head, 'h'}
  local fields = {'f', fence, 'i', r[1], 'e', expires, 'a', now,
    'g', now + tonumber(r[10]), 'G', head}
  if r[8] ~= '' then
    fields[#fields + 1], fields[#fields + 2] = 'k', r[8]
  else
    gone[#gone + 1] = 'k'
  end
  if r[7] ~= '' then
    fields[#fields + 1], fields[#fields + 2] = 'o', r[7]
  else
    gone[#gone + 1] = 'o'
  end
  if final then
    if q.count > 1 then
      fields[#fields + 1], fields[#fields + 2] = 'q', q.count - 1
    else
      gone[#gone + 1], gone[#gone + 2] = 'q', 'n'
    end
  end
  redis.call('HDEL', h, unpack(gone))
  redis.call('HSET', h, unpack(fields))
  redis.call('SET', r[2], h, 'PX', tonumber(r[4]) + tonumber(r[9]))
  local message = string.format('%s %s %d %d', head, r[1], fence, expires)
  if (r[11] or '') == '' then
    redis.pcall('PUBLISH', h, message)
    return true
  end
  redis.pcall('PUBLISH', r[11], 'g ' .. message .. ' ' .. h)
  if watched then
    return true
  end
  local second = first_of(q.live, head)
  local after = second and q.records[second]
  if after then
    local channel = cjson.decode(after)[11] or ''
    if channel ~= '' then
      redis.pcall('PUBLISH', channel, 'n ' .. second .. ' ' .. h)
    end
  end
  return true
end
-- The head hint ``hint`` ('h'), if it still names the first live waiter: {id, its
-- 't:', the fence field}, else nil. A waiter's arrival number only grows, and every
-- script that adds a waiter reads the whole queue first and writes the hint then, so
-- a hinted ticket whose 'w:' is still there, with the same arrival and still live, is
-- still first: only the waiters after it changed. A hint whose waiter left (granted,
-- withdrawn, pruned, or re-queued with a new arrival) no longer matches.
local function hinted_head(h, now, hint)
  if not hint then
    return nil
  end
  local space = string.find(hint, ' ', 1, true)
  local id = string.sub(hint, 1, space - 1)
  local got = redis.call('HMGET', h, 'w:' .. id, 't:' .. id, 'f')
  local w = got[1]
  if not w or not got[2] then
    return nil
  end
  local at = string.find(w, ' ', 1, true)
  if string.sub(w, 1, at - 1) ~= string.sub(hint, space + 1)
      or tonumber(string.sub(w, at + 1)) <= now then
    return nil
  end
  return {id, got[2], got[3]}
end
-- The key is free: grant it to the first live waiter (returns its ticket), or wake
-- that waiter (only it). With ``clear``, the lock fields of the holder that left are
-- removed first, unless the grant overwrites them. ``stored`` is the hash's 'q';
-- ``counted`` how many waiters that leaves (less than 'q' when the caller removed one
-- already; default 'q'). ``hint`` is the hash's 'h': while it holds, a grant the
-- caller's process watches reads three fields instead of the whole queue (a
-- release's grant is the hand-off's critical path); the count of waiters left is then
-- ``counted`` less one (stale waiters, pruned by the next full read, may still be in
-- it).
local function wake_next(h, now, stored, watched, clear, hint, counted)
  local known = watched and hinted_head(h, now, hint)
  if known then
    local id = known[1]
    local q = {head = id, records = {[id] = known[2]}, f = known[3],
      count = counted or stored, live = {}}
    if grant(h, now, q, true, true) then
      return id
    end
  end
  local q = queue_load(h, now)
  if q.head and grant(h, now, q, watched, true) then
    return q.head
  end
  if clear then
    redis.call('HDEL', h, 'i', 'e', 'k', 'o', 'g', 'G')
  end
  if q.head then
    -- pcall: an ACL that denies this user channels must not fail a release whose
    -- writes are done (its waiters cannot subscribe either: they poll).
    redis.pcall('PUBLISH', h, q.head)
  end
  queue_store(h, q.count, stored)
  return nil
end
"""

# Fragment: ``lapsed(g, now)``, whether a grant's claim deadline (field 'g', or
# false when the lock is not an unclaimed grant) has passed: the lock is gone then,
# whatever its expiry says (no tolerance: nobody was told it holds longer).
_LAPSED = """
local function lapsed(g, now)
  return g and tonumber(g) <= now
end
"""

#: KEYS: [1] lock hash, [2] index key of the new lock id, [3] the fence floor.
#: ARGV: [1] lock id, [2] ttl ms, [3] tolerance ms, [4] max fence, [5] user key (""
#: when not hashed), [6] fence mode ("clock" or "counter"), [7] owner label ("" when
#: not recorded), and for a caller with a wait ticket: [8] ticket id, [9] patience ms,
#: [10] the ticket's grant record ("" when it takes no grant; see ``grant``), [11] "1"
#: when the caller's process checks a grant this attempt makes (see CHECK_GRANT).
#: Returns {0} contention ({0, position} for a queued ticket, {0, position, ticket}
#: when this attempt granted the key to that ticket and [11] is "1"), {2} fence overflow
#: (nothing written), {1, fence, expires} taken, {1, fence, expires, lock id} when the
#: key had been granted to this ticket (claimed: the lock id is the grant's).
ACQUIRE = (
    _NOW
    + _LAPSED
    + """
local cur = redis.call('HMGET', KEYS[1], 'i', 'e', 'f', 'q', 'g', 'G')
local ticket = ARGV[8] or ''
local free = not cur[1] or tonumber(cur[2]) <= now - tonumber(ARGV[3]) or lapsed(cur[5], now)
if not free and ticket ~= '' and cur[6] == ticket then
  -- A release granted the key to this ticket while this attempt was on its way.
  redis.call('HDEL', KEYS[1], 'g')
  return {1, tonumber(cur[3]), tonumber(cur[2]), cur[1]}
end
if not free and ticket == '' then
  return {0}
end
local fence
if free then
  -- fence_floors.next_fence: above the key's counter and the floor, and in clock mode
  -- at least the server's clock. Read only for a free key: contention costs no GET.
  fence = math.max(tonumber(cur[3]) or 0, tonumber(redis.call('GET', KEYS[3])) or 0) + 1
  if ARGV[6] == 'clock' then
    fence = math.max(fence, now)
  end
  if fence > tonumber(ARGV[4]) then
    return {2}
  end
end
local waiting = tonumber(cur[4]) or 0
if waiting > 0 or not free then
"""
    + _QUEUE
    + """
  local q = queue_load(KEYS[1], now)
  local live, count, head, first = q.live, q.count, q.head, q.first
  local granted = nil
  if free and head ~= nil and head ~= ticket then
    -- Free, and another waiter is first: a lease ran out, or a grant lapsed, and this
    -- attempt is the first to notice. The key goes to that waiter now.
    if grant(KEYS[1], now, q, ARGV[11] == '1', false) then
      if ARGV[11] == '1' then
        granted = head
      end
      live[head], count, free = nil, count - 1, false
      head, first = first_of(live)  -- the new first waiter, for the head hint
    else
      redis.pcall('PUBLISH', KEYS[1], head)
    end
  end
  if free and (head == nil or head == ticket) then
    if live[ticket] then
      -- The first waiter takes the key itself: the head hint named it.
      redis.call('HDEL', KEYS[1], 'w:' .. ticket, 's:' .. ticket, 't:' .. ticket, 'h')
      count = count - 1
    end
    queue_store(KEYS[1], count, waiting)
  elseif ticket == '' then
    queue_store(KEYS[1], count, waiting)
    return {0}
  else
    local mine = live[ticket]
    if mine == nil then
      mine = redis.call('HINCRBY', KEYS[1], 'n', 1)
      count = count + 1
      redis.call('HSET', KEYS[1], 's:' .. ticket, now)
      if (ARGV[10] or '') ~= '' then
        redis.call('HSET', KEYS[1], 't:' .. ticket, ARGV[10])
      end
    end
    -- The head hint: the first waiter, this one when nobody was ahead.
    local hint = head and (head .. ' ' .. first) or (ticket .. ' ' .. mine)
    redis.call('HSET', KEYS[1], 'w:' .. ticket, mine .. ' ' .. (now + tonumber(ARGV[9])), 'h', hint)
    queue_store(KEYS[1], count, waiting)
    local ahead = 0
    for id, arrival in pairs(live) do
      if arrival < mine and id ~= ticket then
        ahead = ahead + 1
      end
    end
    return {0, ahead, granted}
  end
end
local expires = now + tonumber(ARGV[2])
local fields = {'f', fence, 'i', ARGV[1], 'e', expires, 'a', now}
if ARGV[5] ~= '' then
  fields[#fields + 1], fields[#fields + 2] = 'k', ARGV[5]
end
if ARGV[7] ~= '' then
  fields[#fields + 1], fields[#fields + 2] = 'o', ARGV[7]
else
  -- Not the label of an expired holder taken over (nor one an older version of this
  -- script left behind during a deploy).
  redis.call('HDEL', KEYS[1], 'o')
end
if cur[6] then
  redis.call('HDEL', KEYS[1], 'g', 'G')  -- a lapsed (or expired) grant taken over
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('SET', KEYS[2], KEYS[1], 'PX', tonumber(ARGV[2]) + tonumber(ARGV[3]))
return {1, fence, expires}
"""
)

# Fragment of RELEASE and EXTEND. KEYS: [1] index key, and on a cluster [2] the lock
# hash the caller read from the index. ARGV: [1] lock id, [2] tolerance ms. Leaves
# ``lock`` (the hash name) and ``cur`` = {i, e, q, g}. A grant whose claim deadline
# passed is expired.
# Release and extend resolve the index to the lock hash, require the hash to carry
# this lock id (specs/contract.md, Operations: the stored lock id is re-checked) and
# to be live, then mutate: all inside one script. On a cluster the hash must be
# declared, so the caller reads the index first (one GET) and passes the hash; the
# script checks that the index still names it (the index of another lock id is
# another key, so an index that still names it names it for this lock id).
_RESOLVE = (
    _NOW
    + _LAPSED
    + """
local lock = redis.call('GET', KEYS[1])
if not lock or (KEYS[2] and lock ~= KEYS[2]) then
  return {0}
end
local cur = redis.call('HMGET', lock, 'i', 'e', 'q', 'g', 'h')
if cur[1] ~= ARGV[1] then
  return {0}
end
if tonumber(cur[2]) <= now - tonumber(ARGV[2]) or lapsed(cur[4], now) then
  return {2}
end
"""
)

#: KEYS: as _RESOLVE. ARGV: [1] lock id, [2] tolerance ms, [3] "1" when the caller's
#: process checks a grant this release makes (see CHECK_GRANT).
#: Returns {1} released, {2} expired, {0} not found. The fence 'f' and the last
#: acquisition time 'a' stay (compaction reads 'a'). When waiters queue ('q' > 0),
#: the key is granted to the first live one (or it is woken by PUBLISH); with [3],
#: {1, ticket, lock hash} says to which ticket.
RELEASE = (
    _RESOLVE
    + """
redis.call('DEL', KEYS[1])
local waiting = tonumber(cur[3]) or 0
if waiting == 0 then
  redis.call('HDEL', lock, 'i', 'e', 'k', 'o', 'g', 'G')
else
"""
    + _QUEUE
    + """
  -- The lock fields go in wake_next: a grant overwrites them instead.
  local granted = wake_next(lock, now, waiting, ARGV[3] == '1', true, cur[5])
  if granted and ARGV[3] == '1' then
    return {1, granted, lock}
  end
end
return {1}
"""
)

#: KEYS: [1] lock hash. ARGV: [1] ticket id, [2] tolerance ms, [3] as RELEASE's.
#: Removes the ticket; when the key is free, grants it to (or wakes) the (new) first
#: live waiter. A lock granted to the ticket (the waiter gave up before it used the
#: grant) is released, and the key goes on to the next waiter. Returns 1 when the
#: ticket was queued or held a grant, else 0; with [3], the ticket granted instead of 1.
WITHDRAW = (
    _NOW
    + _LAPSED
    + _QUEUE
    + """
-- The reply after a grant: its ticket when the caller watches it, else 1.
local function watched_grant(granted)
  if granted and ARGV[3] == '1' then
    return granted
  end
  return 1
end
local cur = redis.call('HMGET', KEYS[1], 'i', 'e', 'q', 'g', 'G', 'h')
local waiting = tonumber(cur[3]) or 0
if cur[1] and cur[5] == ARGV[1] then
  if waiting > 0 then
    return watched_grant(wake_next(KEYS[1], now, waiting, ARGV[3] == '1', true, cur[6]))
  end
  redis.call('HDEL', KEYS[1], 'i', 'e', 'k', 'o', 'g', 'G')
  return 1
end
if waiting == 0 or redis.call('HDEL', KEYS[1], 'w:' .. ARGV[1]) == 0 then
  return 0
end
redis.call('HDEL', KEYS[1], 's:' .. ARGV[1], 't:' .. ARGV[1])
if cur[1] and tonumber(cur[2]) > now - tonumber(ARGV[2]) and not lapsed(cur[4], now) then
  queue_store(KEYS[1], waiting - 1, waiting)
  return 1
end
return watched_grant(
  wake_next(KEYS[1], now, waiting, ARGV[3] == '1', false, cur[6], waiting - 1))
"""
)

#: KEYS: [1] lock hash. ARGV: [1] ticket id, [2] "1" when the caller's process checks
#: a grant this check makes in turn.
#: Run by the process whose release (withdrawal, attempt) granted the key to the
#: ticket, once the grant's window is over: if the grant lapsed unclaimed, the key is
#: freed and granted on to the next live waiter (as the attempt of a waiter that
#: noticed the lapse would). Returns {0} (the grant was claimed, or the key moved on),
#: {2, ms} (its window ends in ms: check again then), {1} (freed; nobody to grant
#: to) or {1, ticket} (granted on to that ticket, under [2]).
CHECK_GRANT = (
    _NOW
    + _QUEUE
    + """
local cur = redis.call('HMGET', KEYS[1], 'i', 'q', 'g', 'G', 'h')
if not cur[1] or not cur[3] or cur[4] ~= ARGV[1] then
  return {0}
end
local left = tonumber(cur[3]) - now
if left > 0 then
  return {2, left}
end
local waiting = tonumber(cur[2]) or 0
if waiting == 0 then
  redis.call('HDEL', KEYS[1], 'i', 'e', 'k', 'o', 'g', 'G')
  return {1}
end
local granted = wake_next(KEYS[1], now, waiting, ARGV[2] == '1', true, cur[5])
if granted and ARGV[2] == '1' then
  return {1, granted}
end
return {1}
"""
)

#: KEYS: as _RESOLVE. ARGV: [1] lock id, [2] tolerance ms, [3] ttl ms.
#: Returns {1, expires}, {2} expired, {0} not found. Claims a grant (drops 'g').
EXTEND = (
    _RESOLVE
    + """
local expires = now + tonumber(ARGV[3])
if cur[4] then
  redis.call('HDEL', lock, 'g')
end
redis.call('HSET', lock, 'e', expires)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) + tonumber(ARGV[2]))
return {1, expires}
"""
)

#: KEYS: as _RESOLVE. ARGV: [1] lock id, [2] tolerance ms.
#: The waiter's process claims the key granted to it: the grant no longer lapses.
#: Returns {1} claimed (or claimed already), {2} lapsed or expired, {0} not found.
CLAIM = (
    _RESOLVE
    + """
if cur[4] then
  redis.call('HDEL', lock, 'g')
end
return {1}
"""
)

#: KEYS: [1] lock hash. ARGV: [1] tolerance ms, [2] cleanup guard ms (0: never write).
#: Returns 1 when live. With a guard, removes the lock fields (never 'f' nor 'a') of
#: a lock expired longer ago than the guard, after deciding the answer.
IS_LOCKED = (
    _NOW
    + _LAPSED
    + """
local cur = redis.call('HMGET', KEYS[1], 'i', 'e', 'g')
if not cur[1] then
  return 0
end
local expires = tonumber(cur[2])
if expires > now - tonumber(ARGV[1]) and not lapsed(cur[3], now) then
  return 1
end
local guard = tonumber(ARGV[2])
if guard > 0 and now - expires > guard then
  redis.call('HDEL', KEYS[1], 'i', 'e', 'k', 'o', 'g', 'G')
end
return 0
"""
)

#: KEYS: [1] lock hash. ARGV: [1] tolerance ms.
#: Returns {} or {i, e, a, f, k, o} ('' for a missing k or o).
LOOKUP_BY_KEY = (
    _NOW
    + _LAPSED
    + """
local cur = redis.call('HMGET', KEYS[1], 'i', 'e', 'a', 'f', 'k', 'o', 'g')
if not cur[1] or tonumber(cur[2]) <= now - tonumber(ARGV[1]) or lapsed(cur[7], now) then
  return {}
end
return {cur[1], cur[2], cur[3], cur[4], cur[5] or '', cur[6] or ''}
"""
)

#: KEYS: [1] index key, on a cluster [2] the lock hash read from it (see _RESOLVE).
#: ARGV: [1] lock id, [2] tolerance ms. Returns {} or {hash, i, e, a, f, k, o}.
LOOKUP_BY_ID = (
    _NOW
    + _LAPSED
    + """
local lock = redis.call('GET', KEYS[1])
if not lock or (KEYS[2] and lock ~= KEYS[2]) then
  return {}
end
local cur = redis.call('HMGET', lock, 'i', 'e', 'a', 'f', 'k', 'o', 'g')
if cur[1] ~= ARGV[1] or tonumber(cur[2]) <= now - tonumber(ARGV[2]) or lapsed(cur[7], now) then
  return {}
end
return {lock, cur[1], cur[2], cur[3], cur[4], cur[5] or '', cur[6] or ''}
"""
)

#: KEYS: the lock hashes found by one SCAN. ARGV: [1] tolerance ms.
#: Returns {now, name, i, e, a, f, k, o, name, i, ...} for the live locks among them.
LIST_LIVE = (
    _NOW
    + _LAPSED
    + """
local out = {now}
for _, name in ipairs(KEYS) do
  local cur = redis.call('HMGET', name, 'i', 'e', 'a', 'f', 'k', 'o', 'g')
  if cur[1] and tonumber(cur[2]) > now - tonumber(ARGV[1]) and not lapsed(cur[7], now) then
    table.insert(out, name)
    for j = 1, 4 do table.insert(out, cur[j]) end
    table.insert(out, cur[5] or '')
    table.insert(out, cur[6] or '')
  end
end
return out
"""
)

#: KEYS: lock hashes (the inspector's page). ARGV: none.
#: Returns {name, live waiters, earliest 's:' of them ('' when none is recorded), ...}
#: for the hashes with a live waiter. Read-only: stale places are skipped, not pruned;
#: the queue is read (HGETALL) only where 'q' says somebody waits.
QUEUE_STATS = (
    _NOW
    + """
local out = {}
for _, name in ipairs(KEYS) do
  if (tonumber(redis.call('HGET', name, 'q')) or 0) > 0 then
    local all = redis.call('HGETALL', name)
    local fields = {}
    for j = 1, #all, 2 do fields[all[j]] = all[j + 1] end
    local count, oldest = 0, nil
    for field, value in pairs(fields) do
      if string.sub(field, 1, 2) == 'w:' then
        local space = string.find(value, ' ', 1, true)
        if tonumber(string.sub(value, space + 1)) > now then
          count = count + 1
          local since = tonumber(fields['s:' .. string.sub(field, 3)])
          if since and (oldest == nil or since < oldest) then
            oldest = since
          end
        end
      end
    end
    if count > 0 then
      table.insert(out, name)
      table.insert(out, count)
      table.insert(out, oldest and tostring(oldest) or '')
    end
  end
end
return out
"""
)

#: KEYS: the lock hashes found by one SCAN. ARGV: [1] cleanup guard ms, [2] "1" to
#: only count.
#: Removes the lock fields (never 'f' nor 'a') of locks expired longer ago than the
#: guard, as IS_LOCKED's cleanup does; returns how many.
DELETE_EXPIRED = (
    _NOW
    + """
local n = 0
for _, name in ipairs(KEYS) do
  local cur = redis.call('HMGET', name, 'i', 'e')
  if cur[1] and tonumber(cur[2]) < now - tonumber(ARGV[1]) then
    n = n + 1
    if ARGV[2] ~= '1' then
      redis.call('HDEL', name, 'i', 'e', 'k', 'o', 'g', 'G')
    end
  end
end
return n
"""
)

#: KEYS: [1] the fence floor. ARGV: [1] a fence (at most fence_floors.FLOOR_MAX).
#: Sets the floor to the larger of it and ARGV[1] (never lowers it); returns the floor.
RAISE_FLOOR = """
local floor = tonumber(redis.call('GET', KEYS[1])) or 0
local wanted = tonumber(ARGV[1])
if wanted > floor then
  redis.call('SET', KEYS[1], ARGV[1])
  return wanted
end
return floor
"""

#: KEYS: the lock hashes found by one SCAN. ARGV: none.
#: Returns the largest fence counter 'f' among them (0: none).
HIGHEST_FENCE = """
local top = 0
for _, name in ipairs(KEYS) do
  local f = tonumber(redis.call('HGET', name, 'f')) or 0
  if f > top then
    top = f
  end
end
return top
"""

# Fragment of IDLE_COUNTERS and DELETE_IDLE: ``unheld(h, i, e, q, now, tolerance)``,
# whether lock hash h (whose fields 'i', 'e', 'q' were read as i, e, q) holds no live
# lock and has no live waiter. The queue is read (HGETALL) only when 'q' says somebody
# waits; a waiter whose 'live until' has passed (its process died without withdrawing)
# does not count, as the queue rule would prune it, so a key its dead waiters left
# behind can still be compacted. Writes nothing (dry runs call it too).
_UNHELD = """
local function unheld(h, i, e, q, now, tolerance)
  if i and tonumber(e) > now - tolerance and not lapsed(redis.call('HGET', h, 'g'), now) then
    return false
  end
  if (tonumber(q) or 0) == 0 then
    return true
  end
  local all = redis.call('HGETALL', h)
  for j = 1, #all, 2 do
    if string.sub(all[j], 1, 2) == 'w:' then
      local value = all[j + 1]
      local space = string.find(value, ' ', 1, true)
      if tonumber(string.sub(value, space + 1)) > now then
        return false
      end
    end
  end
  return true
end
"""

#: KEYS: the lock hashes of (part of) one SCAN page. ARGV: [1] cut-off ms,
#: [2] tolerance ms, [3] "1" to stamp.
#: Returns {name, f, a, name, f, a, ...} for the idle counters among them: a hash with
#: a counter 'f', no live lock, no live waiter, last acquired ('a') before the cut-off.
#: With a stamp, a counter without 'a' (kept by a version that deleted 'a' on release)
#: gets 'a' = now; it is not idle then (now is after any cut-off).
IDLE_COUNTERS = (
    _NOW
    + _LAPSED
    + _UNHELD
    + """
local cutoff, tolerance = tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {}
for _, name in ipairs(KEYS) do
  local cur = redis.call('HMGET', name, 'f', 'i', 'e', 'q', 'a')
  if cur[1] and not cur[5] then
    if ARGV[3] == '1' then
      redis.call('HSET', name, 'a', now)
    end
  elseif cur[1] and tonumber(cur[5]) < cutoff
      and unheld(name, cur[2], cur[3], cur[4], now, tolerance) then
    table.insert(out, name)
    table.insert(out, cur[1])
    table.insert(out, cur[5])
  end
end
return out
"""
)

#: KEYS: lock hashes IDLE_COUNTERS returned. ARGV: [1] cut-off ms, [2] tolerance ms,
#: then [2 + j] the fence read of KEYS[j].
#: Deletes each hash (counter, 'a', stale queue fields) that still holds the fence
#: read, still has no live lock and no live waiter, and was still last acquired before
#: the cut-off; returns how many. The caller raised the floor to at least these fences
#: first (fence_floors.compact): an acquire that comes after a delete starts above it,
#: and one that came before changed 'f' and 'a', so the delete skips that hash.
DELETE_IDLE = (
    _NOW
    + _LAPSED
    + _UNHELD
    + """
local cutoff, tolerance = tonumber(ARGV[1]), tonumber(ARGV[2])
local n = 0
for j, name in ipairs(KEYS) do
  local cur = redis.call('HMGET', name, 'f', 'i', 'e', 'q', 'a')
  if cur[1] and tonumber(cur[1]) == tonumber(ARGV[2 + j]) and cur[5]
      and tonumber(cur[5]) < cutoff and unheld(name, cur[2], cur[3], cur[4], now, tolerance) then
    redis.call('DEL', name)
    n = n + 1
  end
end
return n
"""
)

#: Every script by the name the backend calls it by.
SCRIPTS = {
    "acquire": ACQUIRE,
    "release": RELEASE,
    "withdraw": WITHDRAW,
    "extend": EXTEND,
    "claim": CLAIM,
    "check_grant": CHECK_GRANT,
    "is_locked": IS_LOCKED,
    "lookup_by_key": LOOKUP_BY_KEY,
    "lookup_by_id": LOOKUP_BY_ID,
    "list_live": LIST_LIVE,
    "queue_stats": QUEUE_STATS,
    "delete_expired": DELETE_EXPIRED,
    "raise_floor": RAISE_FLOOR,
    "highest_fence": HIGHEST_FENCE,
    "idle_counters": IDLE_COUNTERS,
    "delete_idle": DELETE_IDLE,
}

#: The same scripts for a Redis Cluster: a wake-up is published with SPUBLISH, on the
#: shard channel of the lock hash's name (same slot, so the node that ran the script
#: owns the channel, and only it and its replicas carry the message).
CLUSTER_SCRIPTS = {
    name: lua.replace("redis.pcall('PUBLISH',", "redis.pcall('SPUBLISH',")
    for name, lua in SCRIPTS.items()
}
