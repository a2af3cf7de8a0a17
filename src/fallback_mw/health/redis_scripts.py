"""The Lua scripts behind the Redis health state (health/redis.py). Each transition is one
script, so it is atomic across processes; time is Redis's own clock (`TIME`). They run the
same breaker machine as health/breaker.py: keep the two in step.

A stored number is read with `tonumber(...) or default`: a field that reads as no number
(written by hand, or by another version) counts as absent, and the next write replaces it.
A script that failed on it would read as "Redis unreachable" (health/redis.py), every
process serving on its own breakers, for as long as the key lived. A time further ahead
than any written here (a hand edit, a clock years ahead) is over: read as written, it kept
an upstream skipped, or a credential out of its pool, for ever."""

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# A breaker's `until` / `probe` as ms from now; 0 when due, or further off than `furthest`.
_AHEAD = """
local function ahead(key, field, furthest)
  local left = (tonumber(redis.call('HGET', key, field)) or 0) - now
  if left > 0 and left <= furthest then return left end
  return 0
end
"""

# KEYS[1] breaker hash. ARGV: the probe's lease ms, key ttl ms (longer than the lease; a
# key's ttl is never shortened here, so it outlives a probe that another process took with
# a longer lease), the admitting process's id and the admission's number (the probe's
# owner, for GIVE_BACK), `_AHEAD`'s furthest ms. Returns {admitted, transition, state}: the
# state lets every process report the shared breaker as it is, whoever made the transition.
ADMIT = (
    _NOW
    + _AHEAD
    + """
local key = KEYS[1]
local st = redis.call('HGET', key, 'st')
if st ~= 'open' and st ~= 'half_open' then return {1, '', 'closed'} end  -- or unreadable
local transition = ''
local furthest = tonumber(ARGV[5])
if st == 'open' then
  if ahead(key, 'until', furthest) > 0 then return {0, '', 'open'} end
  redis.call('HSET', key, 'st', 'half_open', 'probe', '0')
  transition = 'half_open'
end
if redis.call('PTTL', key) < tonumber(ARGV[2]) then redis.call('PEXPIRE', key, ARGV[2]) end
if ahead(key, 'probe', furthest) > 0 then return {0, transition, 'half_open'} end
redis.call('HSET', key, 'probe', string.format('%.0f', now + tonumber(ARGV[1])),
  'owner', (ARGV[3] or '') .. ':' .. (ARGV[4] or ''))
return {1, transition, 'half_open'}
"""
)

# KEYS[1] breaker hash. ARGV: failure '1'/'0', window, min_calls, failure_rate,
# base cooldown ms, max cooldown ms, key ttl ms, the fault kind that produced the outcome
# ('' for a real one), the admission that ended ('*': not said, taken as the probe; '-':
# a closed breaker's; else the probe's owner as ADMIT wrote it: a half-open breaker heeds
# only its probe). Returns the transition or ''. The window holds '0' success, '1'
# failure, '2' a fault's failure; 'fault' is the fault that opened the breaker (health/
# breaker.py: its fault failures alone reached the rate, or a fault probe reopened it),
# 'lf' the latest fault kind in a closed breaker's window.
RECORD = (
    _NOW
    + """
local key = KEYS[1]
local failure = ARGV[1]
local base = tonumber(ARGV[5])
local fk = ARGV[8] or ''
local faulted = failure == '1' and fk ~= ''
local st = redis.call('HGET', key, 'st')
if st ~= 'open' and st ~= 'half_open' then st = 'closed' end  -- absent, or unreadable
local result = ''
local function open(cooldown)
  redis.call('HSET', key, 'st', 'open', 'cd', string.format('%.0f', cooldown),
    'until', string.format('%.0f', now + cooldown), 'probe', '0', 'win', '', 'rf', '')
end
if st == 'closed' then
  local mark = failure
  if faulted then mark = '2' end
  local win = (redis.call('HGET', key, 'win') or '') .. mark
  local size = tonumber(ARGV[2])
  if #win > size then win = string.sub(win, -size) end
  local _, fails = string.gsub(win, '[12]', '')
  local _, faults = string.gsub(win, '2', '')
  local lf = redis.call('HGET', key, 'lf') or ''
  if faulted then lf = fk end
  if #win >= tonumber(ARGV[3]) and fails / #win >= tonumber(ARGV[4]) then
    open(base)
    local by = ''
    if faults / #win >= tonumber(ARGV[4]) then by = lf end
    redis.call('HSET', key, 'fault', by, 'lf', '')
    result = 'opened'
  else
    redis.call('HSET', key, 'st', 'closed', 'win', win, 'lf', lf)
  end
elseif st == 'half_open' and (tonumber(redis.call('HGET', key, 'probe')) or 0) > 0
    and (ARGV[9] == '*' or redis.call('HGET', key, 'owner') == ARGV[9]) then
  if failure == '1' then
    open(math.min((tonumber(redis.call('HGET', key, 'cd')) or base) * 2, tonumber(ARGV[6])))
    local by = ''
    if faulted then by = fk end
    redis.call('HSET', key, 'fault', by)
    result = 'reopened'
  else
    redis.call('HSET', key, 'st', 'closed', 'win', '', 'cd', ARGV[5], 'probe', '0',
      'fault', '', 'lf', '')
    result = 'closed'
  end
end
redis.call('PEXPIRE', key, ARGV[7])
return result
"""
)

# KEYS[1] breaker hash. The state it stores (a missing key is a closed breaker), read only.
BREAKER_STATE = "return redis.call('HGET', KEYS[1], 'st') or 'closed'"

# KEYS[1] breaker hash. The fault whose outcomes opened the breaker, '' when it is closed
# or real failures opened it.
OPEN_FAULT = """
local st = redis.call('HGET', KEYS[1], 'st')
if (not st) or st == 'closed' then return '' end
return redis.call('HGET', KEYS[1], 'fault') or ''
"""

# KEYS[1] breaker hash. The fault a skip the breaker refused is booked to: OPEN_FAULT's, or
# for a closed breaker 'rf', the fault whose reset (RESET_FAULT) closed it, until it opens
# again: a refusal made just before that reset asks after it, and is the fault's.
SKIP_FAULT = """
local st = redis.call('HGET', KEYS[1], 'st')
if not st then return '' end
if st == 'closed' then return redis.call('HGET', KEYS[1], 'rf') or '' end
return redis.call('HGET', KEYS[1], 'fault') or ''
"""

# KEYS[1] credential hash, KEYS[2] the hash of credentials a fault marked (index -> fault
# kind). A fault was cleared: those credentials lose their marks (retired or cooling
# down). Returns how many.
RESTORE_FAULT_MARKS = """
local marked = redis.call('HKEYS', KEYS[2])
for _, index in ipairs(marked) do redis.call('HDEL', KEYS[1], index, index .. ':until') end
redis.call('DEL', KEYS[2])
return #marked
"""

# KEYS[1] the hash of credentials a fault marked. ARGV: index, fault kind, key ttl ms.
FAULT_MARKED = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS[1] the hash of credentials a fault marked: one fault kind, or ''.
POOL_FAULT = """
local kinds = redis.call('HVALS', KEYS[1])
return kinds[1] or ''
"""

# KEYS[1] breaker hash. ARGV: base cooldown ms. A fault was cleared: a breaker its
# outcomes opened closes (window and cooldown reset); a closed one forgets its fault
# outcomes; one real failures opened is left alone. Returns 'closed' when it closed the
# breaker, '=closed' when it was closed already (every process that runs it then reports
# it closed: one that saw it open last would otherwise keep reporting it open), '' when it
# stays open.
RESET_FAULT = """
local key = KEYS[1]
local st = redis.call('HGET', key, 'st')
if not st then return '=closed' end
if st == 'closed' then
  local win = redis.call('HGET', key, 'win') or ''
  local kept = string.gsub(win, '2', '')
  redis.call('HSET', key, 'win', kept, 'lf', '')
  return '=closed'
end
local by = redis.call('HGET', key, 'fault') or ''
if by == '' then return '' end
redis.call('HSET', key, 'st', 'closed', 'win', '', 'cd', ARGV[1], 'probe', '0',
  'fault', '', 'lf', '', 'rf', by)
return 'closed'
"""


# KEYS[1] breaker hash, KEYS[2] the url its name was last forgotten for. ARGV: the url the
# name now stands for, the marker's ttl ms. The upstream name now stands for another
# origin: its breaker is dropped (closed), once per change of url: every process sees the
# change on its own reload, and a later one must not drop the breaker the new url's
# failures opened meanwhile ('=' then: nothing done). Returns 'closed' when that closed an
# open or half-open one.
FORGET = """
if redis.call('GET', KEYS[2]) == ARGV[1] then return '=' end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
local st = redis.call('HGET', KEYS[1], 'st')
redis.call('DEL', KEYS[1])
if st and st ~= 'closed' then return 'closed' end
return '=closed'
"""

# A credential's decayed score (health/pool.py: `score`, `CredentialStats`): the score hash
# holds, per index, "successes failures latency_seconds at_ms"; ARGV[HL] the half-life ms.
_STATS = """
local function stat(x)  -- finite and >= 0: `nan` scored NaN, which no comparison picks
  x = tonumber(x or ''); if x and x >= 0 and x < math.huge then return x end end
local function stats(key, i, half_life)
  local v = redis.call('HGET', key, tostring(i)) or ''
  local s, f, l, at = string.match(v, '^(%S+) (%S+) (%S+) (%S+)$')
  s, f, l, at = stat(s), stat(f), stat(l), tonumber(at)
  if not (s and f and l and at) then return 0, 0, 0 end
  local factor = 0.5 ^ (math.max(now - at, 0) / half_life)
  return s * factor, f * factor, l * factor
end
"""

# A credential a 401 retired, while that lasts: its field reads 'retired' and the field
# '<index>:until' holds when the retirement ends, its own CREDENTIAL_TTL (24 h) from the 401.
# The hash lives on while any credential of the pool is marked, so a bare 'retired' lasted
# as long as the pool kept being marked: a key rotated under the same variable was never
# used again. Written so, a process of the version before (which reads only 'retired')
# still reads the credential as retired during a rolling upgrade; a bare 'retired' with
# no end (written by it) reads as retired until its hash expires.
# A credential mark's ms from now; 0 when over, or past any (cooldowns, quotas: 31 days).
_RETIRED = """
local function marked_for(v)
  local left = (tonumber(v) or 0) - now
  if left > 0 and left <= 32 * 86400000 then return left end
  return 0
end
local function retired(key, i, v)
  if v ~= 'retired' then return false end
  local untl = redis.call('HGET', key, i .. ':until')
  return (not tonumber(untl)) or marked_for(untl) > 0
end
"""

# KEYS[1] credential hash, KEYS[2] rotation counter, KEYS[3] session affinity hash (the
# newest sessions), KEYS[4] score hash, KEYS[5] the affinity hash before it. ARGV: pool
# size, excluded as ',0,2,', use session '1'/'0', affinity ttl ms, key ttl ms, selection
# 'score' / 'round_robin', score half-life ms, the session's field, sessions per hash.
# The sessions remembered are bounded, as in memory: a caller's fresh session id on every
# request made a key each, an hour apiece, without limit. When the newest hash is full it
# becomes the older one (the oldest sessions forgotten); a session found in the older one
# moves back to the newest. Returns the index or -1.
PICK = (
    _NOW
    + _STATS
    + _RETIRED
    + """
local function score(i)
  local s, f, l = stats(KEYS[4], i, tonumber(ARGV[7]))
  local lat = l / math.max(s, 1)  -- pool.py `score`: over at least one answer
  return ((s + 1) / (s + f + 1)) / (1 + lat)
end
local function usable(i)
  if string.find(ARGV[2], ',' .. i .. ',', 1, true) then return false end
  local v = redis.call('HGET', KEYS[1], tostring(i))
  if not v then return true end
  if retired(KEYS[1], i, v) then return false end
  return marked_for(v) == 0  -- a retirement that ended reads as no number
end
local function remember(i)
  redis.call('HSET', KEYS[3], ARGV[8], tostring(i))
  if redis.call('HLEN', KEYS[3]) >= tonumber(ARGV[9]) then
    redis.call('RENAME', KEYS[3], KEYS[5])
    redis.call('PEXPIRE', KEYS[5], ARGV[4])
  else
    redis.call('PEXPIRE', KEYS[3], ARGV[4])
  end
end
local size = tonumber(ARGV[1])
if ARGV[3] == '1' then
  local newest = redis.call('HGET', KEYS[3], ARGV[8])
  local bound = tonumber(newest or redis.call('HGET', KEYS[5], ARGV[8])) or -1
  if bound >= 0 and bound < size and usable(bound) then
    if newest then redis.call('PEXPIRE', KEYS[3], ARGV[4]) else remember(bound) end
    return bound
  end
end
local turn = redis.pcall('INCR', KEYS[2])
if type(turn) ~= 'number' then  -- a counter that reads as no integer starts again
  turn = 1
  redis.call('SET', KEYS[2], '1')
end
local start = turn - 1
redis.call('PEXPIRE', KEYS[2], ARGV[5])
local best = -1
local best_score = -1
if ARGV[6] ~= 'score' then
  -- the turn is taken among the usable credentials (pool.py: CredentialPool.pick)
  local ok = {}
  for i = 0, size - 1 do
    if usable(i) then ok[#ok + 1] = i end
  end
  if #ok > 0 then best = ok[(start % #ok) + 1] end
else
  for offset = 0, size - 1 do
    local i = (start + offset) % size
    if usable(i) then
      local value = score(i)
      if value > best_score then best, best_score = i, value end
    end
  end
end
if best >= 0 and ARGV[3] == '1' then remember(best) end
return best
"""
)

# KEYS[1] score hash. ARGV: index, ok '1' / '0', latency seconds, half-life ms, key ttl ms.
OBSERVE = (
    _NOW
    + _STATS
    + """
local s, f, l = stats(KEYS[1], ARGV[1], tonumber(ARGV[4]))
if ARGV[2] == '1' then
  s = s + 1
  l = l + math.max(tonumber(ARGV[3]), 0)
else
  f = f + 1
end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.6f %.6f %.6f %.0f', s, f, l, now))
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""
)

# KEYS[1] credential hash. ARGV: index, 'retire' / 'cool_down', cool-down ms, key ttl ms
# (also how long a retirement lasts). The key lives at least the ttl, and as long as its
# furthest mark (a quota that resets in days): a later, shorter mark never cuts it short.
MARK = (
    _NOW
    + _RETIRED
    + """
local current = redis.call('HGET', KEYS[1], ARGV[1])
local ttl = tonumber(ARGV[4])
if ARGV[2] == 'retire' then
  redis.call('HSET', KEYS[1], ARGV[1], 'retired',
    ARGV[1] .. ':until', string.format('%.0f', now + ttl))
elseif not retired(KEYS[1], ARGV[1], current) then
  redis.call('HDEL', KEYS[1], ARGV[1] .. ':until')
  local untl = now + tonumber(ARGV[3])
  local held = now + marked_for(current)
  if held > untl then untl = held end
  redis.call('HSET', KEYS[1], ARGV[1], string.format('%.0f', untl))
  if untl - now > ttl then ttl = untl - now end
end
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], string.format('%.0f', ttl))
end
return 1
"""
)


# KEYS[1] breaker hash. ARGV: a process id, an admission's number. An admission whose
# answer never came back (Redis hung, the call timed out) may still have run once Redis
# resumed: the probe slot it took, if it still holds it, is freed. Returns 1 if it did.
GIVE_BACK = """
local key = KEYS[1]
if redis.call('HGET', key, 'st') == 'half_open'
    and redis.call('HGET', key, 'owner') == ARGV[1] .. ':' .. ARGV[2] then
  redis.call('HSET', key, 'probe', '0')
  return 1
end
return 0
"""

# KEYS[1] breaker hash. ARGV[1]: the admission that ended, as RECORD's ARGV[9]: only the
# probe's own frees the slot.
RELEASE = """
if redis.call('HGET', KEYS[1], 'st') == 'half_open'
    and (ARGV[1] == '*' or redis.call('HGET', KEYS[1], 'owner') == ARGV[1]) then
  redis.call('HSET', KEYS[1], 'probe', '0')
end
return 0
"""


# KEYS[1] breaker hash, KEYS[2] credential hash. ARGV: pool size (1: no pool), ADMIT's
# ARGV[5]. Returns {ms until the breaker admits, ms until a credential is usable or -1 when
# all are retired}: health/breaker.py `admits_in`, health/pool.py `CredentialPool.usable_in`.
USABLE_IN = (
    _NOW
    + _AHEAD
    + _RETIRED
    + """
local breaker = 0
if redis.call('HGET', KEYS[1], 'st') == 'open' then
  breaker = ahead(KEYS[1], 'until', tonumber(ARGV[2]))
end
local size = tonumber(ARGV[1])
if size < 2 then return {breaker, 0} end
local soonest = -1
for i = 0, size - 1 do
  local v = redis.call('HGET', KEYS[2], tostring(i))
  local wait = 0
  if retired(KEYS[2], i, v) then wait = -1
  elseif v then wait = marked_for(v) end
  if wait >= 0 and (soonest < 0 or wait < soonest) then soonest = wait end
end
return {breaker, soonest}
"""
)
