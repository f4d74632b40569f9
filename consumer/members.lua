-- Say a consumer of a group is alive, and list the live ones.
--
-- The members sorted set scores each consumer name with the instant its
-- membership ends (Redis server time, so clocks of the consumers' machines
-- do not matter). Members whose time has passed are dropped.
--
-- KEYS[1] members (zset)   ARGV[1] consumer name   ARGV[2] TTL (ms)
-- Returns the live members' names, sorted.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
local names = redis.call('ZRANGE', KEYS[1], 0, -1)
table.sort(names)
return names
