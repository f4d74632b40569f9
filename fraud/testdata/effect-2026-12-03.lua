-- Apply one transfer.settled event exactly once: check the dedupe marker,
-- compute the verdict, then write the effect AND the marker. A Lua script runs
-- atomically, so a crash can leave either everything or nothing; all checks
-- come before the first write because scripts do not roll back.
--
-- Every key it writes has a bounded life (docs/operations.md, "Redis memory"):
-- the marker lives the dedupe TTL; the verdict and the day's totals live until
-- the end of the transfer's settlement day (UTC) plus the retention, all to
-- the same instant, so a verdict and the totals it counts in go together; the
-- sender's window lives the dedupe TTL plus two windows after its last write;
-- the alerts stream keeps the retention; the days index is trimmed with it.
--
-- KEYS[1] dedupe marker         KEYS[2] verdict (per transfer)
-- KEYS[3] sender's day totals   KEYS[4] day's senders set
-- KEYS[5] days index zset       KEYS[6] sender window zset
-- KEYS[7] stats hash            KEYS[8] alerts stream
-- KEYS[9] the partition's lease (ownership.go)
-- KEYS[10] the sender's approved transfers in the window (zset, as KEYS[6]):
--          the only ones a late arrival can still send to review
-- KEYS[11] the audit stream (Config.AuditLen): the effects in the order applied
-- KEYS[12] the batch's gate (a hash, one per pipeline: its senders whose
--          event failed in it; written only on a failure)
-- KEYS[13] the sender's window entries (a hash, bounded like the window):
--          field 'n' numbers the transfers as they arrive; field <number>
--          holds 'cum:amount:event_id:transfer_id', cum being the running
--          sum of the amounts of the window's transfers up to this one in
--          the window's order (by settled_at, then arrival)
-- ARGV[1] marker TTL (s)        ARGV[2] event_id           ARGV[3] transfer_id
-- ARGV[4] from_account          ARGV[5] amount_cents       ARGV[6] settled_at (ms)
-- ARGV[7] window (ms)           ARGV[8] amount limit       ARGV[9] window limit
-- ARGV[10] to_account           ARGV[11] currency
-- ARGV[12] when the verdict and day keys expire (unix ms; 0: the settlement
--          day is already past the retention, keep neither)
-- ARGV[13] day (YYYY-MM-DD)     ARGV[14] day number (days since the epoch)
-- ARGV[15] oldest day number the index keeps
-- ARGV[16] window key TTL (ms)  ARGV[17] alerts kept from this id on (ms)
-- ARGV[18] verdict key prefix (the verdicts of later transfers this one may
--          send to review are at ARGV[18] .. transfer_id)
-- ARGV[19] the lease value the consumer holds (its fencing token); empty
--          when the consumer applies events without owning the partition
--          (its single steps, for tests and tools)
-- ARGV[20] how many entries the audit stream keeps, about (0: no audit)
-- ARGV[21] '1' when the event's marker was found under an earlier number of
--          partitions (layouts.go): a duplicate, counted as one
-- Per-key order within a pipeline: a batch's calls run one after another and
-- none can stop the next, so an error that struck one call of a sender and
-- cleared before its next (a key fixed, memory freed) would let the later
-- event take effect first. A failing call records its sender in the batch's
-- gate; the sender's later calls in the batch find it and are held (HELD),
-- to be applied again after the failed one, in order.
-- Returns {outcome, revised}: outcome 0 for a duplicate, 1 for approve,
-- 2 for review; revised, how many later transfers it sent to review.
--
-- Arrival order does not change the verdicts. A transfer is judged over the
-- sender's transfers settled in the window before it that have arrived. One
-- that arrives late (after transfers settled up to a window after it) is
-- counted into theirs now: each of them whose window total passes the limit
-- with it is sent to review (verdict, counter and an alert with revised=1).
-- Totals only grow as transfers arrive, so a verdict only ever moves from
-- approve to review, and once every transfer has arrived each verdict is the
-- one settled order gives.
-- Fencing: only the partition's owner applies its events. A consumer whose
-- lease expired or moved (it stalled, or the group rebalanced) is refused,
-- however late its command arrives; nothing is written.
if redis.call('HEXISTS', KEYS[12], ARGV[4]) == 1 then
  return redis.error_reply('HELD an earlier event of sender ' .. ARGV[4] .. ' failed in this batch')
end

local function apply()
  if ARGV[19] ~= '' and redis.call('GET', KEYS[9]) ~= ARGV[19] then
    return redis.error_reply('FENCED partition lease ' .. KEYS[9] .. ' is no longer held by this consumer')
  end

  if ARGV[21] == '1' or redis.call('EXISTS', KEYS[1]) == 1 then
    redis.call('HINCRBY', KEYS[7], 'duplicates_skipped', 1)
    return {0, 0}
  end

  local amount = tonumber(ARGV[5])
  local at = tonumber(ARGV[6])
  local window = tonumber(ARGV[7])
  local expireAt = tonumber(ARGV[12])
  local limit = tonumber(ARGV[9])

  -- The sender's window (KEYS[6]) holds its recent transfers by number
  -- (KEYS[13]), scored by settled_at; numbers grow with arrival, so a
  -- transfer arriving in settled order goes last. Each entry carries the
  -- running sum up to it, so the total of any span of the window is two
  -- lookups (O(log k)), not a scan of it. Windows written as
  -- 'amount:event:transfer' members (before the entries) are converted once.
  local function entry(num)
    local v = redis.call('HGET', KEYS[13], num)
    if not v then
      return nil
    end
    local cum, amt, ev, tr = string.match(v, '^(-?%d+):(%d+):([^:]+):(.+)$')
    return {cum = tonumber(cum), amount = tonumber(amt), event = ev, transfer = tr}
  end
  local function value(cum, amt, ev, tr)
    return string.format('%d:%d:', cum, amt) .. ev .. ':' .. tr
  end
  local function convert()
    local old = redis.call('ZRANGE', KEYS[6], 0, -1, 'WITHSCORES')
    local approved = {}
    for _, m in ipairs(redis.call('ZRANGE', KEYS[10], 0, -1)) do
      approved[m] = true
    end
    redis.call('DEL', KEYS[6], KEYS[10], KEYS[13])
    local cum = 0
    for i = 1, #old, 2 do
      local amt, rest = string.match(old[i], '^(%d+):(.+)$')
      if amt then
        local num = string.format('%015d', redis.call('HINCRBY', KEYS[13], 'n', 1))
        cum = cum + tonumber(amt)
        redis.call('HSET', KEYS[13], num, string.format('%d:', cum) .. old[i])
        redis.call('ZADD', KEYS[6], old[i + 1], num)
        if approved[old[i]] then
          redis.call('ZADD', KEYS[10], old[i + 1], num)
        end
      end
    end
  end
  local last = redis.call('ZREVRANGE', KEYS[6], 0, 0, 'WITHSCORES')
  if #last > 0 and string.find(last[1], ':', 1, true) then
    convert()
    last = redis.call('ZREVRANGE', KEYS[6], 0, 0, 'WITHSCORES')
  end
  -- The window's newest transfer: where an in-order arrival goes, and
  -- the last transfer of its window.
  local lastEntry
  if #last > 0 then
    lastEntry = entry(last[1])
    if not lastEntry then
      error('window entry ' .. last[1] .. ' of sender ' .. ARGV[4] .. ' missing (' .. KEYS[13] .. ')')
    end
  end
  -- And its oldest (the first of the window of an in-order arrival, as a
  -- rule, and what the trim below looks at).
  local head = {}
  if #last > 0 then
    head = redis.call('ZRANGE', KEYS[6], 0, 0, 'WITHSCORES')
  end
  -- The window's total over (lo, hi], from the running sums of its first
  -- and last transfers there.
  local function total(lo, hi)
    local first
    if #head > 0 and tonumber(head[2]) > lo then
      if tonumber(head[2]) > hi then
        return 0
      end
      first = head
    else
      first = redis.call('ZRANGEBYSCORE', KEYS[6], '(' .. lo, hi, 'LIMIT', 0, 1)
    end
    if #first == 0 then
      return 0
    end
    local l = lastEntry
    if tonumber(last[2]) > hi then
      l = entry(redis.call('ZREVRANGEBYSCORE', KEYS[6], hi, '(' .. lo, 'LIMIT', 0, 1)[1])
    end
    local f = lastEntry
    if first[1] ~= last[1] then
      f = entry(first[1])
    end
    if not f or not l then
      error('window entries of sender ' .. ARGV[4] .. ' missing (' .. KEYS[13] .. ')')
    end
    return l.cum - f.cum + f.amount
  end

  -- Reads first (an inconsistent window fails here, before any write).
  -- The sender's total over (at - window, at], this transfer included.
  local windowTotal = amount + total(at - window, at)
  local verdict, reason = 'approve', ''
  if amount > tonumber(ARGV[8]) then
    verdict, reason = 'review', 'amount'
  elseif windowTotal > limit then
    verdict, reason = 'review', 'velocity'
  end
  -- Where it goes: after every transfer settled up to its instant; its
  -- running sum is theirs plus its amount, and every transfer settled after
  -- it (none when transfers arrive in order, the usual case) has this
  -- amount added to its own.
  local cumBefore = 0
  local prev = {}
  if #last > 0 and tonumber(last[2]) <= at then
    cumBefore = lastEntry.cum -- in order: after the newest
  elseif #last > 0 then
    prev = redis.call('ZREVRANGEBYSCORE', KEYS[6], at, '-inf', 'LIMIT', 0, 1)
  end
  if #prev > 0 then
    local e = entry(prev[1])
    if not e then
      error('window entry ' .. prev[1] .. ' of sender ' .. ARGV[4] .. ' missing')
    end
    cumBefore = e.cum
  elseif #last > 0 and tonumber(last[2]) > at then
    local e = entry(head[1])
    if not e then
      error('window entry ' .. head[1] .. ' of sender ' .. ARGV[4] .. ' missing')
    end
    cumBefore = e.cum - e.amount
  end
  local after = {}
  if #last > 0 and tonumber(last[2]) > at then
    after = redis.call('ZRANGEBYSCORE', KEYS[6], '(' .. at, '+inf')
  end
  -- Approved transfers settled in [at, at + window) that arrived before this
  -- one: their windows include it, so it may push them over the limit. Only
  -- approved ones can change, and they are kept apart (KEYS[10]). Those
  -- settled at this very instant (a payroll settled in one transaction
  -- shares one) have this transfer's window total, so they matter only when
  -- it is over the limit; the ones after it are none at all when transfers
  -- arrive in order. Each later one's total gains this transfer's amount.
  local ties = {}
  if windowTotal > limit then
    ties = redis.call('ZRANGEBYSCORE', KEYS[10], at, at)
  end
  local pushed = {}
  if #after > 0 then
    local later = redis.call('ZRANGEBYSCORE', KEYS[10], '(' .. at, '(' .. (at + window), 'WITHSCORES')
    for i = 1, #later, 2 do
      local lscore = tonumber(later[i + 1])
      local ltotal = amount + total(lscore - window, lscore)
      if ltotal > limit then
        table.insert(pushed, {later[i], ltotal})
      end
    end
  end
  -- What revising them takes, read now (a verdict key of the wrong type
  -- fails here, not after the writes): their entries and current verdicts.
  local revisions = {}
  local function toRevise(lnum, ltotal)
    local e = entry(lnum)
    local current
    if e then
      current = redis.call('GET', ARGV[18] .. e.transfer)
    end
    table.insert(revisions, {num = lnum, total = ltotal, e = e, current = current})
  end
  for _, m in ipairs(ties) do
    toRevise(m, windowTotal)
  end
  for _, p in ipairs(pushed) do
    toRevise(p[1], p[2])
  end

  local newest = at
  if #last > 0 then
    newest = math.max(newest, tonumber(last[2]))
  end
  local oldest = at
  if #head > 0 then
    oldest = math.min(oldest, tonumber(head[2]))
  end
  local trim = oldest < newest - 2 * window -- below, after the window's writes

  -- Keys written after the first non-idempotent write (the window's
  -- arrival counter) must not fail mid-script: a wrong type would leave
  -- half an effect behind. Check those this event writes, before any
  -- write. The window and the approved set when read already failed on a
  -- wrong type; the entries hash needs no check: the counter is its first
  -- write, and a write that fails there leaves only idempotent ones.
  local audit = tonumber(ARGV[20])
  local typed = {{KEYS[7], 'hash'}}
  if expireAt > 0 then
    table.insert(typed, {KEYS[3], 'hash'})
  end
  if verdict == 'approve' or trim then
    table.insert(typed, {KEYS[10], 'zset'})
  end
  if verdict == 'review' or #revisions > 0 then
    table.insert(typed, {KEYS[8], 'stream'})
  end
  if audit > 0 then
    table.insert(typed, {KEYS[11], 'stream'})
  end
  for _, k in ipairs(typed) do
    local t = redis.call('TYPE', k[1]).ok
    if t ~= 'none' and t ~= k[2] then
      return redis.error_reply('WRONGTYPE ' .. k[1] .. ' is a ' .. t .. ', want ' .. k[2])
    end
  end

  -- Idempotent writes first: if one fails, a retry repeats them harmlessly.
  if expireAt > 0 then
    redis.call('SET', KEYS[2], verdict, 'PXAT', expireAt)
    -- The day's senders and the days index change only with a new sender
    -- or day (their expiry and trim too: the same instant for every
    -- transfer of a day, and a new day at least once a day; a --retention
    -- changed in the middle of a day applies to the day keys created after).
    if redis.call('SADD', KEYS[4], ARGV[4]) == 1 then
      redis.call('PEXPIREAT', KEYS[4], expireAt)
    end
    if redis.call('ZADD', KEYS[5], ARGV[14], ARGV[13]) == 1 then
      redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', '(' .. ARGV[15])
    end
  end
  local num = string.format('%015d', redis.call('HINCRBY', KEYS[13], 'n', 1))
  redis.call('HSET', KEYS[13], num, value(cumBefore + amount, amount, ARGV[2], ARGV[3]))
  for _, m in ipairs(after) do
    local e = entry(m)
    if e then
      redis.call('HSET', KEYS[13], m, value(e.cum + amount, e.amount, e.event, e.transfer))
    end
  end
  redis.call('ZADD', KEYS[6], at, num)
  if verdict == 'approve' then
    redis.call('ZADD', KEYS[10], at, num)
  end
  -- Forget transfers older than the newest one seen minus two windows: events
  -- of one sender can arrive up to a window late and still be judged right.
  if trim then
    local cutoff = '(' .. (newest - 2 * window)
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', cutoff)) do
      redis.call('HDEL', KEYS[13], m)
    end
    redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', cutoff)
    redis.call('ZREMRANGEBYSCORE', KEYS[10], '-inf', cutoff)
  end
  -- The running sums only grow while the sender keeps sending: bring them
  -- back near zero long before they leave a double's exact integers.
  local firstLeft
  if cumBefore + amount > 2 ^ 48 then
    firstLeft = entry(redis.call('ZRANGE', KEYS[6], 0, 0)[1])
  end
  if firstLeft and firstLeft.cum - firstLeft.amount > 2 ^ 48 then
    local base = firstLeft.cum - firstLeft.amount
    for _, m in ipairs(redis.call('ZRANGE', KEYS[6], 0, -1)) do
      local e = entry(m)
      if e then
        redis.call('HSET', KEYS[13], m, value(e.cum - base, e.amount, e.event, e.transfer))
      end
    end
  end
  redis.call('PEXPIRE', KEYS[6], ARGV[16])
  redis.call('PEXPIRE', KEYS[10], ARGV[16])
  redis.call('PEXPIRE', KEYS[13], ARGV[16])
  -- Then the counters, which must happen once.
  if expireAt > 0 then
    redis.call('HINCRBY', KEYS[3], 'sent_cents', ARGV[5])
    if redis.call('HINCRBY', KEYS[3], 'transfers', 1) == 1 then
      redis.call('PEXPIREAT', KEYS[3], expireAt) -- the same instant for the whole day
    end
  end
  redis.call('HINCRBY', KEYS[7], 'verdicts', 1)
  if audit > 0 then
    redis.call('XADD', KEYS[11], 'MAXLEN', '~', audit, '*',
      'event_id', ARGV[2], 'transfer_id', ARGV[3], 'from_account', ARGV[4], 'verdict', verdict)
  end
  if verdict == 'review' then
    redis.call('HINCRBY', KEYS[7], 'reviews', 1)
    redis.call('XADD', KEYS[8], 'MINID', ARGV[17], '*',
      'event_id', ARGV[2], 'transfer_id', ARGV[3], 'from_account', ARGV[4],
      'to_account', ARGV[10], 'amount_cents', ARGV[5], 'currency', ARGV[11],
      'window_total_cents', string.format('%d', windowTotal), 'reason', reason)
  end
  -- Transfers this one pushes over the limit go to review (and leave the
  -- approved set: they can change no more).
  local revised = 0
  for _, r in ipairs(revisions) do
    redis.call('ZREM', KEYS[10], r.num)
    if r.current == 'approve' then
      local e = r.e
      redis.call('SET', ARGV[18] .. e.transfer, 'review', 'KEEPTTL')
      redis.call('HINCRBY', KEYS[7], 'reviews', 1)
      redis.call('XADD', KEYS[8], 'MINID', ARGV[17], '*',
        'event_id', e.event, 'transfer_id', e.transfer, 'from_account', ARGV[4],
        'amount_cents', string.format('%d', e.amount), 'window_total_cents', string.format('%d', r.total),
        'reason', 'velocity', 'revised', '1', 'revised_by', ARGV[2])
      revised = revised + 1
    end
  end
  redis.call('SET', KEYS[1], verdict, 'EX', ARGV[1])
  if verdict == 'review' then
    return {2, revised}
  end
  return {1, revised}
end

-- An error is a reply ({err = ...}, returned or raised by a command) or,
-- raised by Lua itself, a string.
local ok, res = pcall(apply)
local isError = type(res) == 'table' and res.err ~= nil
if ok and not isError then
  return res
end
redis.call('HSET', KEYS[12], ARGV[4], 1)
redis.call('PEXPIRE', KEYS[12], 60000)
if isError then
  return res
end
return redis.error_reply(tostring(res))
