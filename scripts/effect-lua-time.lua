-- Times fraud/effect.lua's own Lua work outside Redis (anti-fraud
-- spends about 30 µs of Redis per event, of which the commands inside the
-- script are under half). redis.call is a small in-memory stub; its own
-- cost, measured apart with as many calls, is subtracted (an underestimate:
-- the stub's later branches cost more than the one timed, so "lua own" reads
-- a little high). Events of 1,000 senders settled in order, 100 per call, as
-- `outbox bench consume` sends them. Needs Debian's lua5.1 (Redis embeds
-- Lua 5.1):
--
--   lua5.1 scripts/effect-lua-time.lua fraud/effect.lua [calls]
local src = assert(io.open(arg[1])):read('*a')
local calls, nEvents, rounds = 0, 100, tonumber(arg[2] or '200')
local zs, kv, h = {}, {}, {}
local function call(cmd, k, a, b, ...)
  calls = calls + 1
  if cmd == 'GET' then return kv[k] or false
  elseif cmd == 'HMGET' then return {false, false, false}
  elseif cmd == 'HKEYS' then return {}
  elseif cmd == 'EXISTS' then return kv[k] and 1 or 0
  elseif cmd == 'ZREVRANGE' then local z = zs[k]; if z and #z > 0 then return {z[#z]} end return {}
  elseif cmd == 'ZRANGE' then local z = zs[k]; if z and #z > 0 then return {z[1]} end return {}
  elseif cmd == 'ZRANGEBYSCORE' or cmd == 'ZREVRANGEBYSCORE' or cmd == 'MGET' then return {}
  elseif cmd == 'ZADD' then local z = zs[k] or {}; zs[k] = z; z[#z + 1] = b; return 1
  elseif cmd == 'HINCRBY' then local t = h[k] or {}; h[k] = t; t[a] = (t[a] or 0) + tonumber(b); return t[a]
  elseif cmd == 'SET' then kv[k] = a; return {ok = 'OK'}
  elseif cmd == 'TYPE' then return {ok = 'none'}
  elseif cmd == 'XADD' then return '1-0'
  else return 1 end
end
redis = {call = call, pcall = call, error_reply = function(m) return {err = m} end}
local f = assert(loadstring(src, "=effect"))
-- 1000 senders; each call 100 events of distinct senders, settled in order.
local function mk(round)
  local K = {'days', 'stats', 'alerts', 'lease', 'audit', 'gate'}
  local A = {'604800', '3600000', '5000000', '10000000', '20000', '605000000', '1733000000000', 'fraud:verdict:', '', '0'}
  for j = 1, nEvents do
    local s = ((round * nEvents + j) % 1000)
    local ev = string.format('0193a5c6-%04d-7000-8000-%012d', j, round)
    local tr = string.format('0193a5c7-%04d-7000-8000-%012d', j, round)
    local from = 'acct-' .. s
    for _, x in ipairs({'seen:' .. ev, 'verdict:' .. tr, 'day:2026-12-05:' .. from, 'day:2026-12-05', 'window:' .. from, 'approved:' .. from, 'entries:' .. from}) do K[#K + 1] = x end
    local amt = (j % 100 == 0) and '6000000' or tostring(1 + (j * 7919) % 200000)
    for _, x in ipairs({ev, tr, from, amt, tostring(1733380000000 + round * 1000 + j), 'acct-x', 'BRL', '1733500000000', '2026-12-05', '20062', '0'}) do A[#A + 1] = x end
  end
  return K, A
end
local batches = {}
for r = 1, rounds do batches[r] = {mk(r)} end
local t0 = os.clock()
for r = 1, rounds do
  KEYS, ARGV = batches[r][1], batches[r][2]
  f()
end
local total = os.clock() - t0
local nc = calls
-- the stub's own cost: the same number of calls of a representative mix
calls = 0
local t1 = os.clock()
for i = 1, nc do call('EXISTS', 'seen:x') end
local stub = os.clock() - t1
local ev = rounds * nEvents
print(string.format('events %d  total %.2f us/event  stub %.2f us/event  lua own %.2f us/event  redis.calls %.1f/event',
  ev, total / ev * 1e6, stub / ev * 1e6, (total - stub) / ev * 1e6, nc / ev))
