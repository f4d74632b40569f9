-- Trim one stream atomically with the checks that make it safe: never remove
-- an entry that a consumer group has not read (after its last-delivered-id)
-- or has read and not acknowledged (its lowest pending id). A stream with no
-- group is left alone: its consumers may not have created their group yet.
--
-- KEYS[1] stream
-- ARGV[1] max length (0 = none)  ARGV[2] minimum id by retention ("" = none)
-- ARGV[3] most entries to remove in one call
-- Returns the number of entries removed.
local function cmp(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  if am ~= bm then return am < bm and -1 or 1 end
  if as ~= bs then return as < bs and -1 or 1 end
  return 0
end
local function lower(a, b)
  if a == nil then return b end
  if b == nil then return a end
  return cmp(a, b) <= 0 and a or b
end

if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return 0 end

local floor = nil
for _, g in ipairs(groups) do
  local name, last
  for i = 1, #g, 2 do
    if g[i] == 'name' then name = g[i + 1] end
    if g[i] == 'last-delivered-id' then last = g[i + 1] end
  end
  local pending = redis.call('XPENDING', KEYS[1], name)
  if pending[1] > 0 then
    floor = lower(floor, pending[2]) -- its oldest unacknowledged entry
  else
    -- Everything up to last-delivered-id is read and acknowledged.
    local ms, seq = string.match(last, '^(%d+)-(%d+)$')
    floor = lower(floor, ms .. '-' .. string.format('%d', tonumber(seq) + 1))
  end
end

local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
if first == nil or cmp(floor, first[1]) <= 0 then return 0 end

-- What the policies would remove: entries below the retention id, and the
-- oldest entries beyond the maximum length (at most ARGV[3] of them, and
-- only those below the floor are ever read). An entry violating either goes.
local target = nil
if ARGV[2] ~= '' then target = ARGV[2] end
local maxlen = tonumber(ARGV[1])
if maxlen > 0 then
  local excess = redis.call('XLEN', KEYS[1]) - maxlen
  if excess > 0 then
    local n = math.min(excess, tonumber(ARGV[3]))
    local ids = redis.call('XRANGE', KEYS[1], '-', floor, 'COUNT', n + 1)
    local keep = floor -- fewer than n+1 entries below the floor: all of them may go
    if #ids == n + 1 then keep = ids[n + 1][1] end
    if target == nil or cmp(keep, target) > 0 then target = keep end
  end
end
if target == nil then return 0 end
if cmp(floor, target) < 0 then target = floor end
return redis.call('XTRIM', KEYS[1], 'MINID', target)
