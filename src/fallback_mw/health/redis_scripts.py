"""The Lua scripts behind the Redis health state (health/redis.py). Each transition is one
script, so it is atomic across processes; time is Redis's own clock (`TIME`). They run the
same breaker machine as health/breaker.py: keep the two in step."""

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS[1] breaker hash. ARGV: probe lease ms, key ttl ms. Returns {admitted, transition}.
ADMIT = (
    _NOW
    + """
local key = KEYS[1]
local st = redis.call('HGET', key, 'st')
if (not st) or st == 'closed' then return {1, ''} end
local transition = ''
if st == 'open' then
  if now < tonumber(redis.call('HGET', key, 'until') or '0') then return {0, ''} end
  redis.call('HSET', key, 'st', 'half_open', 'probe', '0')
  transition = 'half_open'
end
redis.call('PEXPIRE', key, ARGV[2])
if tonumber(redis.call('HGET', key, 'probe') or '0') > now then return {0, transition} end
redis.call('HSET', key, 'probe', string.format('%.0f', now + tonumber(ARGV[1])))
return {1, transition}
"""
)

# KEYS[1] breaker hash. ARGV: failure '1'/'0', window, min_calls, failure_rate,
# base cooldown ms, max cooldown ms, key ttl ms. Returns the transition or ''.
RECORD = (
    _NOW
    + """
local key = KEYS[1]
local failure = ARGV[1]
local base = tonumber(ARGV[5])
local st = redis.call('HGET', key, 'st') or 'closed'
local result = ''
local function open(cooldown)
  redis.call('HSET', key, 'st', 'open', 'cd', string.format('%.0f', cooldown),
    'until', string.format('%.0f', now + cooldown), 'probe', '0', 'win', '')
end
if st == 'closed' then
  local win = (redis.call('HGET', key, 'win') or '') .. failure
  local size = tonumber(ARGV[2])
  if #win > size then win = string.sub(win, -size) end
  local _, fails = string.gsub(win, '1', '')
  if #win >= tonumber(ARGV[3]) and fails / #win >= tonumber(ARGV[4]) then
    open(base)
    result = 'opened'
  else
    redis.call('HSET', key, 'st', 'closed', 'win', win)
  end
elseif st == 'half_open' and tonumber(redis.call('HGET', key, 'probe') or '0') > 0 then
  if failure == '1' then
    open(math.min(tonumber(redis.call('HGET', key, 'cd') or ARGV[5]) * 2, tonumber(ARGV[6])))
    result = 'reopened'
  else
    redis.call('HSET', key, 'st', 'closed', 'win', '', 'cd', ARGV[5], 'probe', '0')
    result = 'closed'
  end
end
redis.call('PEXPIRE', key, ARGV[7])
return result
"""
)

# KEYS[1] credential hash, KEYS[2] rotation counter, KEYS[3] session affinity key.
# ARGV: pool size, excluded as ',0,2,', use session '1'/'0', affinity ttl ms, key ttl ms.
# Returns the index or -1.
PICK = (
    _NOW
    + """
local function usable(i)
  if string.find(ARGV[2], ',' .. i .. ',', 1, true) then return false end
  local v = redis.call('HGET', KEYS[1], tostring(i))
  if not v then return true end
  if v == 'retired' then return false end
  return tonumber(v) <= now
end
local size = tonumber(ARGV[1])
if ARGV[3] == '1' then
  local bound = tonumber(redis.call('GET', KEYS[3]) or '-1')
  if bound >= 0 and bound < size and usable(bound) then
    redis.call('PEXPIRE', KEYS[3], ARGV[4])
    return bound
  end
end
local start = redis.call('INCR', KEYS[2]) - 1
redis.call('PEXPIRE', KEYS[2], ARGV[5])
for offset = 0, size - 1 do
  local i = (start + offset) % size
  if usable(i) then
    if ARGV[3] == '1' then redis.call('SET', KEYS[3], tostring(i), 'PX', ARGV[4]) end
    return i
  end
end
return -1
"""
)

# KEYS[1] credential hash. ARGV: index, 'retire' / 'cool_down', cool-down ms, key ttl ms.
MARK = (
    _NOW
    + """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[2] == 'retire' then
  redis.call('HSET', KEYS[1], ARGV[1], 'retired')
elseif current ~= 'retired' then
  local untl = now + tonumber(ARGV[3])
  if current and tonumber(current) > untl then untl = tonumber(current) end
  redis.call('HSET', KEYS[1], ARGV[1], string.format('%.0f', untl))
end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""
)


# KEYS[1] breaker hash. A half-open probe that proved nothing frees its slot.
RELEASE = """
if redis.call('HGET', KEYS[1], 'st') == 'half_open' then
  redis.call('HSET', KEYS[1], 'probe', '0')
end
return 0
"""
