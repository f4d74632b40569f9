-- Apply the effects of a run of transfer.settled events, each exactly once:
-- for each event, check its dedupe marker, compute the verdict, then write
-- the effect AND the marker. A Lua script runs atomically, so a crash leaves
-- either the whole call or none of it; an event's checks all come before its
-- first write, because scripts do not roll back: an event that fails, fails
-- whole, and the call goes on with the next one.
--
-- One call applies several events (Handle sends a batch's events in calls of
-- up to effectsPerCall): what is the same for all of them (the fence, the
-- gate, the types of the shared keys, the counters) is checked or written
-- once per call, not once per event.
--
-- Every key it writes has a bounded life (docs/operations.md, "Redis memory"):
-- the marker lives the dedupe TTL; the verdict and the day's totals live until
-- the end of the transfer's settlement day (UTC) plus the retention, all to
-- the same instant, so a verdict and the totals it counts in go together; the
-- sender's window lives the dedupe TTL plus two windows after its last write;
-- the alerts stream keeps the retention; the days index is trimmed with it.
--
-- The call's keys:
-- KEYS[1] days index zset       KEYS[2] stats hash
-- KEYS[3] alerts stream         KEYS[4] the partition's lease (ownership.go)
-- KEYS[5] the audit stream (Config.AuditLen): the effects in the order applied
-- KEYS[6] the batch's gate (a hash, one per batch: its senders whose event
--         failed in it, and under the field '' (no sender has an empty
--         name) the number of the last call that ran when another follows
--         it in one pipeline; written only on a failure or for a call
--         that another follows)
-- then 7 per event, from KEYS[6 + 7(j-1) + 1] for the j-th:
--   +1 dedupe marker            +2 verdict (per transfer)
--   +3 sender's day totals      +4 day's senders set
--   +5 sender window zset (below)
--   +6 the sender's approved set and +7 its window entries hash: the
--      window's state in its second format, read only to convert it
--
-- The call's arguments:
-- ARGV[1] marker TTL (s)        ARGV[2] window (ms)
-- ARGV[3] amount limit          ARGV[4] window limit
-- ARGV[5] oldest day number the index keeps
-- ARGV[6] window key TTL (ms)   ARGV[7] alerts kept from this id on (ms)
-- ARGV[8] verdict key prefix (the verdicts of later transfers an event may
--         send to review are at ARGV[8] .. transfer_id)
-- ARGV[9] the lease value the consumer holds (its fencing token); empty
--         when the consumer applies events without owning the partition
--         (its single steps, for tests and tools)
-- ARGV[10] how many entries the audit stream keeps, about (0: no audit)
-- ARGV[11] the call's number in its batch (1, 2, ...)
-- ARGV[12] the number of the call it follows in its pipeline ('0': none)
-- ARGV[13] '1' when another call follows it in its pipeline
-- then 11 per event, from ARGV[13 + 11(j-1) + 1] for the j-th:
--   +1 event_id                 +2 transfer_id
--   +3 from_account             +4 amount_cents
--   +5 settled_at (ms)          +6 to_account
--   +7 currency
--   +8 when the verdict and day keys expire (unix ms; 0: the settlement
--      day is already past the retention, keep neither)
--   +9 day (YYYY-MM-DD)         +10 day number (days since the epoch)
--   +11 '1' when the event's marker was found under an earlier number of
--       partitions (layouts.go): a duplicate, counted as one
--
-- The sender's window is one sorted set: each of its recent transfers is a
-- member 'at|tie|cum|amount|flag|event_id|transfer_id' scored by at, its
-- settled_at (ms; in the member too, so that reads need no WITHSCORES,
-- whose doubles Redis formats with printf). tie numbers the transfers
-- settled at the same instant in their order of arrival (8 digits, so that
-- members of one score sort by it); cum is the running sum of the amounts
-- of the window's transfers up to this one, in the window's order (by
-- settled_at, then arrival); flag is 'a' while the transfer is approved
-- (the only ones a late arrival can still send to review), 'r' otherwise.
-- No ':' in it: a consumer of the second format's version takes a member
-- without one for an arrival number, finds no entry for it and fails the
-- event before any write, where a ':' would have sent it converting the
-- window as its oldest format (a rolling upgrade runs both for a while).
--
-- Per-key order: a batch's events run one after another and none can stop
-- the next, so an error that struck one event of a sender and not its next
-- (a key fixed, memory freed) would let the later event take effect first.
-- A failing event records its sender in the batch's gate; the sender's later
-- events in the batch (in this call or a later one of the batch) find it
-- and are held (HELD), to be applied again after the failed one, in order.
-- The same goes for a whole call: the consumer sends several calls of a
-- batch in one pipeline, and one of them may not run at all (refused for
-- memory, or an error raised outside an event) while the next does. So a
-- call that another follows in its pipeline records its number in the gate,
-- and a call that does not find its predecessor's number there holds all
-- its events (HELD): none of them runs after a call that did not.
--
-- Returns one element per event: {outcome, revised} (outcome 0 for a
-- duplicate, 1 for approve, 2 for review; revised, how many later transfers
-- it sent to review), or the event's error. A call whose lease is lost
-- fails whole (FENCED) and writes nothing.
--
-- Arrival order does not change the verdicts. A transfer is judged over the
-- sender's transfers settled in the window before it that have arrived. One
-- that arrives late (after transfers settled up to a window after it) is
-- counted into theirs now: each of them whose window total passes the limit
-- with it is sent to review (verdict, counter and an alert with revised=1).
-- Totals only grow as transfers arrive, so a verdict only ever moves from
-- approve to review, and once every transfer has arrived each verdict is the
-- one settled order gives.
local nKeys, nArgs = 7, 11
local callArgs = 13
local events = (#ARGV - callArgs) / nArgs
if events ~= math.floor(events) or #KEYS ~= 6 + nKeys * events then
  return redis.error_reply('ERR effect script called with ' .. #KEYS .. ' keys and ' .. #ARGV .. ' arguments')
end

-- Fencing: only the partition's owner applies its events. A consumer whose
-- lease expired or moved (it stalled, or the group rebalanced) is refused,
-- however late its command arrives; nothing is written.
if ARGV[9] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[9] then
  return redis.error_reply('FENCED partition lease ' .. KEYS[4] .. ' is no longer held by this consumer')
end

local daysKey, statsKey, alertsKey, auditKey, gateKey = KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[6]
local window = tonumber(ARGV[2])
local amountLimit = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local audit = tonumber(ARGV[10])

-- The counters it adds to at the end must be integers (or absent): a
-- field that is not (a hand edit) would fail the call after its events'
-- writes.
for _, v in ipairs(redis.pcall('HMGET', statsKey, 'verdicts', 'reviews', 'duplicates_skipped')) do
  if v and not string.match(v, '^-?%d+$') then
    return redis.error_reply('ERR stats ' .. statsKey .. ' holds a counter that is not an integer: ' .. v)
  end
end

-- The senders held in this batch: those of the gate, and those that fail
-- in this call.
local held, ran = {}, nil
local gate = redis.call('HGETALL', gateKey)
for i = 1, #gate, 2 do
  if gate[i] == '' then
    ran = gate[i + 1]
  else
    held[gate[i]] = true
  end
end
if ARGV[12] ~= '0' and ran ~= ARGV[12] then
  local replies = {}
  for j = 1, events do
    replies[j] = redis.error_reply('HELD call ' .. ARGV[12] .. ' of this batch did not run')
  end
  return replies
end

-- What the call writes once: the counters and the windows' expiry; and
-- what it learned once: the types of the keys it checked, the days it added.
local stats = {verdicts = 0, reviews = 0, duplicates_skipped = 0}
local windows, windowOrder = {}, {}
local types, added = {}, {}
local none = {} -- an empty list to iterate

-- A member of the window, parsed (nil: not of this format), and back.
-- Its running sum makes the total of any span of the window two lookups
-- (O(log k)), not a scan of it.
local function parse(m)
  local sc, tie, cum, amt, flag, ev, tr = string.match(m, '^(%d+)|(%d+)|(-?%d+)|(%d+)|([ar])|([^|]+)|(.+)$')
  if not sc then
    return nil
  end
  return {m = m, score = tonumber(sc), tie = tonumber(tie), cum = tonumber(cum), amount = tonumber(amt),
    approved = flag == 'a', event = ev, transfer = tr}
end
-- Only its numbers (score, tie, cum, amount), without a table: what the
-- usual reads need.
local function numbers(m)
  local sc, tie, cum, amt = string.match(m, '^(%d+)|(%d+)|(-?%d+)|(%d+)|[ar]|[^|]+|.')
  if not sc then
    return nil
  end
  return tonumber(sc), tonumber(tie), tonumber(cum), tonumber(amt)
end
local function member(score, tie, cum, amount, approved, event, transfer)
  local flag = 'r'
  if approved then
    flag = 'a'
  end
  return string.format('%d|%08d|%d|%d|%s|%s|%s', score, tie, cum, amount, flag, event, transfer)
end
local function remember(e)
  return member(e.score, e.tie, e.cum, e.amount, e.approved, e.event, e.transfer)
end
local function malformed(m, from, key)
  error('window member ' .. tostring(m) .. ' of sender ' .. from .. ' is of no known format (' .. key .. ')')
end
local function full(m, from, key)
  local e = parse(m)
  if not e then
    malformed(m, from, key)
  end
  return e
end
local function nums(m, from, key)
  local sc, tie, cum, amt = numbers(m)
  if not sc then
    malformed(m, from, key)
  end
  return sc, tie, cum, amt
end
-- Score bounds as arguments: integers formatted as such (a number
-- argument is formatted with %.17g).
local function above(v)
  return string.format('(%d', v)
end
local function upto(v)
  return string.format('%d', v)
end
-- ZADD of score/member pairs, in chunks (unpack has a limit).
local function zadd(key, pairs)
  for i = 1, #pairs, 1000 do
    redis.call('ZADD', key, unpack(pairs, i, math.min(i + 999, #pairs)))
  end
end
-- A key's type is what this event may write to it, or none; each key is
-- asked once per call (the call's own writes keep the right types).
local function wrongType(key, want)
  local t = types[key]
  if not t then
    t = redis.call('TYPE', key).ok
    types[key] = t
  end
  if t ~= 'none' and t ~= want then
    return redis.error_reply('WRONGTYPE ' .. key .. ' is a ' .. t .. ', want ' .. want)
  end
  return nil
end

-- Windows of the earlier formats are converted once: numbered members with
-- their entries in the entries hash and the approved ones in the approved
-- set (the second format), or 'amount:event:transfer' members (the first).
local function convert(windowKey, approvedKey, entriesKey, from)
  local old = redis.call('ZRANGE', windowKey, 0, -1, 'WITHSCORES')
  local approved = {}
  for _, m in ipairs(redis.call('ZRANGE', approvedKey, 0, -1)) do
    approved[m] = true
  end
  local numbered = not string.find(old[1], ':', 1, true)
  local new, cum, prevScore, tie = {}, 0, nil, 0
  for i = 1, #old, 2 do
    local e
    if numbered then
      local v = redis.call('HGET', entriesKey, old[i])
      local c, amt, ev, tr
      if v then
        c, amt, ev, tr = string.match(v, '^(-?%d+):(%d+):([^:]+):(.+)$')
      end
      if not c then
        error('window entry ' .. old[i] .. ' of sender ' .. from .. ' missing (' .. entriesKey .. ')')
      end
      e = {cum = tonumber(c), amount = tonumber(amt), event = ev, transfer = tr}
    else
      local amt, ev, tr = string.match(old[i], '^(%d+):([^:]+):(.+)$')
      if amt then
        cum = cum + tonumber(amt)
        e = {cum = cum, amount = tonumber(amt), event = ev, transfer = tr}
      end
    end
    if e then
      local score = tonumber(old[i + 1])
      if score == prevScore then
        tie = tie + 1
      else
        tie = 0
      end
      prevScore = score
      e.score, e.tie, e.approved = score, tie, approved[old[i]] == true
      table.insert(new, old[i + 1])
      table.insert(new, remember(e))
    end
  end
  redis.call('DEL', windowKey, approvedKey, entriesKey)
  zadd(windowKey, new)
end

-- The window of the event being applied: its key and sender, whether it
-- has transfers, and the numbers of its newest (n) and oldest (o).
local wKey, wFrom, wAny
local nScore, nTie, nCum, oScore, oCum, oAmt

-- The window's total over (lo, hi], from the running sums of its first
-- and last transfers there.
local function total(lo, hi)
  if not wAny then
    return 0
  end
  local fCum, fAmt
  if oScore > lo then
    if oScore > hi then
      return 0
    end
    fCum, fAmt = oCum, oAmt
  else
    local r = redis.call('ZRANGEBYSCORE', wKey, above(lo), upto(hi), 'LIMIT', '0', '1')
    if #r == 0 then
      return 0
    end
    local _, _, c, a = nums(r[1], wFrom, wKey)
    fCum, fAmt = c, a
  end
  local lCum = nCum
  if nScore > hi then
    local r = redis.call('ZREVRANGEBYSCORE', wKey, upto(hi), above(lo), 'LIMIT', '0', '1')
    local _, _, c = nums(r[1], wFrom, wKey)
    lCum = c
  end
  return lCum - fCum + fAmt
end

-- The j-th event's effect; an error reply (or a raised error) fails it
-- whole, before its first write.
local function apply(j)
  local kb, ab = 6 + nKeys * (j - 1), callArgs + nArgs * (j - 1)
  local seenKey, verdictKey, dayKey, daySendersKey, windowKey = KEYS[kb + 1], KEYS[kb + 2], KEYS[kb + 3], KEYS[kb + 4], KEYS[kb + 5]
  local eventID, transferID, from = ARGV[ab + 1], ARGV[ab + 2], ARGV[ab + 3]
  local amountArg, atArg = ARGV[ab + 4], ARGV[ab + 5]
  local expireAtArg, day, dayNo = ARGV[ab + 8], ARGV[ab + 9], ARGV[ab + 10]

  if ARGV[ab + 11] == '1' or redis.call('EXISTS', seenKey) == 1 then
    local bad = wrongType(statsKey, 'hash') -- where it is counted
    if bad then
      return bad
    end
    stats.duplicates_skipped = stats.duplicates_skipped + 1
    return {0, 0}
  end

  local amount = tonumber(amountArg)
  local at = tonumber(atArg)
  local expireAt = tonumber(expireAtArg)

  -- The window's newest transfer (where an in-order arrival goes, and the
  -- last of its window) and its oldest (the first of an in-order arrival's
  -- window, as a rule, and what the trim below looks at).
  wKey, wFrom, wAny = windowKey, from, false
  local last = redis.call('ZREVRANGE', windowKey, '0', '0')
  if #last > 0 then
    nScore, nTie, nCum = numbers(last[1])
    if not nScore then
      convert(windowKey, KEYS[kb + 6], KEYS[kb + 7], from)
      last = redis.call('ZREVRANGE', windowKey, '0', '0')
      if #last > 0 then
        nScore, nTie, nCum = nums(last[1], from, windowKey)
      end
    end
    wAny = #last > 0
  end
  if wAny then
    local head = redis.call('ZRANGE', windowKey, '0', '0')
    local _
    oScore, _, oCum, oAmt = nums(head[1], from, windowKey)
  end

  -- Reads first (an inconsistent window fails here, before any write).
  -- The sender's total over (at - window, at], this transfer included.
  local before = total(at - window, at)
  local windowTotal = amount + before
  local verdict, reason = 'approve', ''
  if amount > amountLimit then
    verdict, reason = 'review', 'amount'
  elseif windowTotal > limit then
    verdict, reason = 'review', 'velocity'
  end
  -- Where it goes: after every transfer settled up to its instant; its
  -- running sum is theirs plus its amount, and every transfer settled after
  -- it (none when transfers arrive in order, the usual case: later stays
  -- nil) has this amount added to its own.
  local cumBefore, tie = 0, 0
  local later
  if wAny and nScore <= at then
    cumBefore = nCum -- in order: after the newest
    if nScore == at then
      tie = nTie + 1
    end
  elseif wAny then
    local prev = redis.call('ZREVRANGEBYSCORE', windowKey, atArg, '-inf', 'LIMIT', '0', '1')
    if #prev > 0 then
      local sc, t, c = nums(prev[1], from, windowKey)
      cumBefore = c
      if sc == at then
        tie = t + 1
      end
    else
      cumBefore = oCum - oAmt
    end
    later = {}
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', windowKey, '(' .. atArg, '+inf')) do
      table.insert(later, full(m, from, windowKey))
    end
  end
  -- Approved transfers settled in [at, at + window) that arrived before this
  -- one: their windows include it, so it may push them over the limit. Only
  -- approved ones can change. Those settled at this very instant (a payroll
  -- settled in one transaction shares one) have this transfer's window
  -- total, so they matter only when it takes that total over the limit:
  -- once the instant's total is over, none of them is approved (whatever
  -- took it over sent them all to review), so the instant is read once,
  -- not at each of its transfers. The ones after it are none at all when
  -- transfers arrive in order. Each later one's total gains this
  -- transfer's amount. (revisions stays nil when there are none.)
  local revisions
  if windowTotal > limit and before <= limit and wAny and nScore >= at then
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', windowKey, atArg, atArg)) do
      local e = full(m, from, windowKey)
      if e.approved then
        revisions = revisions or {}
        table.insert(revisions, {e = e, total = windowTotal})
      end
    end
  end
  for _, e in ipairs(later or none) do
    if e.approved and e.score < at + window then
      local ltotal = amount + total(e.score - window, e.score)
      if ltotal > limit then
        revisions = revisions or {}
        table.insert(revisions, {e = e, total = ltotal})
      end
    end
  end
  -- What revising them takes, read now (a verdict key of the wrong type
  -- fails here, not after the writes): their current verdicts, in one MGET
  -- per thousand, which answers nil for a key that is missing and for one
  -- of another type alike: the type of those is asked.
  if revisions then
    local names = {}
    for i, r in ipairs(revisions) do
      names[i] = ARGV[8] .. r.e.transfer
    end
    for i = 1, #names, 1000 do
      local cur = redis.call('MGET', unpack(names, i, math.min(i + 999, #names)))
      for k, v in ipairs(cur) do
        revisions[i + k - 1].current = v
      end
    end
    for i, r in ipairs(revisions) do
      if not r.current then
        local t = redis.call('TYPE', names[i]).ok
        if t ~= 'none' then
          return redis.error_reply('WRONGTYPE ' .. names[i] .. ' is a ' .. t .. ', want string')
        end
      end
    end
  end

  local newest, oldest = at, at
  if wAny then
    newest = math.max(newest, nScore)
    oldest = math.min(oldest, oScore)
  end
  local trim = oldest < newest - 2 * window -- below, after the window's writes

  -- Every write after the event's first must not fail: a wrong type would
  -- leave half an effect behind. The first is the day totals' (a wrong type
  -- there fails the event before anything is written), or, for a transfer
  -- whose day is past the retention, the window's, which was read above.
  -- Check the others this event writes, before any write (each key once per
  -- call); the verdicts a revision rewrites were read above too.
  local bad = wrongType(statsKey, 'hash')
  if not bad and expireAt > 0 then
    bad = wrongType(daySendersKey, 'set') or wrongType(daysKey, 'zset')
  end
  if not bad and (verdict == 'review' or revisions) then
    bad = wrongType(alertsKey, 'stream')
  end
  if not bad and audit > 0 then
    bad = wrongType(auditKey, 'stream')
  end
  if bad then
    return bad
  end

  if expireAt > 0 then
    -- The day's totals, then the verdict. The day's senders set gains the
    -- sender with its first transfer of the day, and the days index its
    -- day once per call; their expiry and trim go with them (the same
    -- instant for every transfer of a day, and a new day at least once a
    -- day; a --retention changed in the middle of a day applies to the day
    -- keys created after).
    redis.call('HINCRBY', dayKey, 'sent_cents', amountArg)
    local n = redis.pcall('HINCRBY', dayKey, 'transfers', '1')
    if type(n) == 'table' then
      -- Its field is no integer (a hand edit): take the first one back,
      -- so that the event fails whole.
      redis.call('HINCRBY', dayKey, 'sent_cents', '-' .. amountArg)
      return n
    end
    if n == 1 then
      redis.call('PEXPIREAT', dayKey, expireAtArg)
      if redis.call('SADD', daySendersKey, from) == 1 then
        redis.call('PEXPIREAT', daySendersKey, expireAtArg)
      end
    end
    redis.call('SET', verdictKey, verdict, 'PXAT', expireAtArg)
    if not added[day] then
      added[day] = true
      if redis.call('ZADD', daysKey, dayNo, day) == 1 then
        redis.call('ZREMRANGEBYSCORE', daysKey, '-inf', '(' .. ARGV[5])
      end
    end
  end
  -- The window: the later transfers' running sums and the revised ones'
  -- flags, then this transfer.
  local mine = member(at, tie, cumBefore + amount, amount, verdict == 'approve', eventID, transferID)
  if later or revisions then
    local changed = {}
    for _, e in ipairs(later or none) do
      e.cum = e.cum + amount
      changed[e.m] = e
    end
    for _, r in ipairs(revisions or none) do
      r.e.approved = false -- sent to review: it can change no more
      changed[r.e.m] = r.e
    end
    local gone, new = {}, {}
    for m, e in pairs(changed) do
      table.insert(gone, m)
      table.insert(new, upto(e.score))
      table.insert(new, remember(e))
    end
    for i = 1, #gone, 1000 do
      redis.call('ZREM', windowKey, unpack(gone, i, math.min(i + 999, #gone)))
    end
    table.insert(new, atArg)
    table.insert(new, mine)
    zadd(windowKey, new)
  else
    redis.call('ZADD', windowKey, atArg, mine)
  end
  -- Forget transfers older than the newest one seen minus two windows: events
  -- of one sender can arrive up to a window late and still be judged right.
  if trim then
    redis.call('ZREMRANGEBYSCORE', windowKey, '-inf', above(newest - 2 * window))
  end
  -- The running sums only grow while the sender keeps sending: bring them
  -- back near zero long before they leave a double's exact integers.
  if cumBefore + amount > 2 ^ 48 then
    local first = redis.call('ZRANGE', windowKey, '0', '0')
    local _, _, c, a = nums(first[1], from, windowKey)
    local base = c - a
    if base > 2 ^ 48 then
      local rebased = {}
      for _, m in ipairs(redis.call('ZRANGE', windowKey, '0', '-1')) do
        local e = full(m, from, windowKey)
        e.cum = e.cum - base
        table.insert(rebased, upto(e.score))
        table.insert(rebased, remember(e))
      end
      redis.call('DEL', windowKey)
      zadd(windowKey, rebased)
    end
  end
  if not windows[windowKey] then -- its expiry, at the end of the call
    windows[windowKey] = true
    table.insert(windowOrder, windowKey)
  end
  -- Then the counters (added up, written at the end of the call), the
  -- audit entry, the alerts.
  stats.verdicts = stats.verdicts + 1
  if audit > 0 then
    redis.call('XADD', auditKey, 'MAXLEN', '~', ARGV[10], '*',
      'event_id', eventID, 'transfer_id', transferID, 'from_account', from, 'verdict', verdict)
  end
  if verdict == 'review' then
    stats.reviews = stats.reviews + 1
    redis.call('XADD', alertsKey, 'MINID', ARGV[7], '*',
      'event_id', eventID, 'transfer_id', transferID, 'from_account', from,
      'to_account', ARGV[ab + 6], 'amount_cents', amountArg, 'currency', ARGV[ab + 7],
      'window_total_cents', string.format('%d', windowTotal), 'reason', reason)
  end
  -- Transfers this one pushes over the limit go to review.
  local revised = 0
  for _, r in ipairs(revisions or none) do
    if r.current == 'approve' then
      local e = r.e
      redis.call('SET', ARGV[8] .. e.transfer, 'review', 'KEEPTTL')
      stats.reviews = stats.reviews + 1
      redis.call('XADD', alertsKey, 'MINID', ARGV[7], '*',
        'event_id', e.event, 'transfer_id', e.transfer, 'from_account', from,
        'amount_cents', string.format('%d', e.amount), 'window_total_cents', string.format('%d', r.total),
        'reason', 'velocity', 'revised', '1', 'revised_by', eventID)
      revised = revised + 1
    end
  end
  redis.call('SET', seenKey, verdict, 'EX', ARGV[1])
  if verdict == 'review' then
    return {2, revised}
  end
  return {1, revised}
end

local replies = {}
for j = 1, events do
  local from = ARGV[callArgs + nArgs * (j - 1) + 3]
  if held[from] then
    replies[j] = redis.error_reply('HELD an earlier event of sender ' .. from .. ' failed in this batch')
  else
    -- An error is a reply ({err = ...}, returned or raised by a command)
    -- or, raised by Lua itself, a string.
    local ok, res = pcall(apply, j)
    local failed = type(res) == 'table' and res.err ~= nil
    if not ok and not failed then
      res, failed = redis.error_reply(tostring(res)), true
    end
    replies[j] = res
    if failed then
      held[from] = true
      redis.call('HSET', gateKey, from, 1)
      redis.call('PEXPIRE', gateKey, 60000)
    end
  end
end

-- What the call's applied events add up to: their counters and windows'
-- expiry. The stats' type was checked by the events that count in it, and
-- a write after the call's first cannot fail for memory.
for _, k in ipairs(windowOrder) do
  redis.call('PEXPIRE', k, ARGV[6])
end
for _, field in ipairs({'verdicts', 'reviews', 'duplicates_skipped'}) do
  if stats[field] > 0 then
    redis.call('HINCRBY', statsKey, field, string.format('%d', stats[field]))
  end
end
if ARGV[13] == '1' then
  redis.call('HSET', gateKey, '', ARGV[11])
  redis.call('PEXPIRE', gateKey, 60000)
end
return replies
