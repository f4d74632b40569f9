-- Say a consumer of a group is alive, and list the live ones.
--
-- The members sorted set scores each consumer name with the instant its
-- membership ends (Redis server time, so clocks of the consumers' machines
-- do not matter). Members whose time has passed are dropped.
--
-- A live consumer calls it several times a second, so each member's score
-- moves forward several times a second: one whose score stops moving has
-- stalled (presence.go), whatever its TTL.
--
-- KEYS[1] members (zset)   ARGV[1] consumer name   ARGV[2] TTL (ms)
-- Returns the live members' names, sorted, each followed by its score.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
local all = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local members = {}
for i = 1, #all, 2 do
    members[#members + 1] = {all[i], all[i + 1]}
end
table.sort(members, function(a, b) return a[1] < b[1] end)
local out = {}
for _, m in ipairs(members) do
    out[#out + 1] = m[1]
    out[#out + 1] = m[2]
end
return out
