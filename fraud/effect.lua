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
-- KEYS[5] days index zset       KEYS[6] sender window zset (below)
-- KEYS[7] stats hash            KEYS[8] alerts stream
-- KEYS[9] the partition's lease (ownership.go)
-- KEYS[10] the sender's approved set and KEYS[13] its window entries hash:
--          the window's state before 2026-12-04, read only to convert it
-- KEYS[11] the audit stream (Config.AuditLen): the effects in the order applied
-- KEYS[12] the batch's gate (a hash, one per pipeline: its senders whose
--          event failed in it; written only on a failure)
--
-- The sender's window (KEYS[6]) is one sorted set: each of its recent
-- transfers is a member 'at|tie|cum|amount|flag|event_id|transfer_id'
-- scored by at, its settled_at (ms; in the member too, so that reads need
-- no WITHSCORES, whose doubles Redis formats with printf). tie numbers the
-- transfers settled at the same instant in their order of arrival (8
-- digits, so that members of one score sort by it); cum is the running sum
-- of the amounts of the window's transfers up to this one, in the window's
-- order (by settled_at, then arrival); flag is 'a' while the transfer is approved (the only ones a
-- late arrival can still send to review), 'r' otherwise. No ':' in it: a
-- consumer of the previous version takes a member without one for an
-- arrival number, finds no entry for it and fails the event before any
-- write, where a ':' would have sent it converting the window as its
-- oldest format (a rolling upgrade runs both versions for a while).
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
    redis.call('HINCRBY', KEYS[7], 'duplicates_skipped', '1')
    return {0, 0}
  end

  local amount = tonumber(ARGV[5])
  local at = tonumber(ARGV[6])
  local window = tonumber(ARGV[7])
  local expireAt = tonumber(ARGV[12])
  local limit = tonumber(ARGV[9])

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
  local function member(e)
    local flag = 'r'
    if e.approved then
      flag = 'a'
    end
    return string.format('%d|%08d|%d|%d|', e.score, e.tie, e.cum, e.amount) .. flag .. '|' .. e.event .. '|' .. e.transfer
  end
  local function must(e, m)
    if not e then
      error('window member ' .. tostring(m) .. ' of sender ' .. ARGV[4] .. ' is of no known format (' .. KEYS[6] .. ')')
    end
    return e
  end
  -- ZADD of score/member pairs, in chunks (unpack has a limit).
  local function zadd(pairs)
    for i = 1, #pairs, 1000 do
      redis.call('ZADD', KEYS[6], unpack(pairs, i, math.min(i + 999, #pairs)))
    end
  end
  -- Windows of the earlier formats are converted once: numbered members
  -- with their entries in KEYS[13] and the approved ones in KEYS[10] (until
  -- 2026-12-04), or 'amount:event:transfer' members (before that).
  local function convert()
    local old = redis.call('ZRANGE', KEYS[6], 0, -1, 'WITHSCORES')
    local approved = {}
    for _, m in ipairs(redis.call('ZRANGE', KEYS[10], 0, -1)) do
      approved[m] = true
    end
    local numbered = not string.find(old[1], ':', 1, true)
    local new, cum, prevScore, tie = {}, 0, nil, 0
    for i = 1, #old, 2 do
      local e
      if numbered then
        local v = redis.call('HGET', KEYS[13], old[i])
        local c, amt, ev, tr
        if v then
          c, amt, ev, tr = string.match(v, '^(-?%d+):(%d+):([^:]+):(.+)$')
        end
        if not c then
          error('window entry ' .. old[i] .. ' of sender ' .. ARGV[4] .. ' missing (' .. KEYS[13] .. ')')
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
        table.insert(new, member(e))
      end
    end
    redis.call('DEL', KEYS[6], KEYS[10], KEYS[13])
    zadd(new)
  end

  -- The window's newest transfer (where an in-order arrival goes, and the
  -- last of its window) and its oldest (the first of an in-order arrival's
  -- window, as a rule, and what the trim below looks at).
  local last = redis.call('ZREVRANGE', KEYS[6], '0', '0')
  local newestE, oldestE
  if #last > 0 then
    newestE = parse(last[1])
  end
  if #last > 0 and not newestE then
    convert()
    last = redis.call('ZREVRANGE', KEYS[6], '0', '0')
    if #last > 0 then
      newestE = must(parse(last[1]), last[1])
    end
  end
  if newestE then
    local head = redis.call('ZRANGE', KEYS[6], '0', '0')
    oldestE = must(parse(head[1]), head[1])
  end
  -- Score bounds as arguments: integers formatted as such (a number
  -- argument is formatted with %.17g).
  local function above(v)
    return string.format('(%d', v)
  end
  local function upto(v)
    return string.format('%d', v)
  end
  -- The window's total over (lo, hi], from the running sums of its first
  -- and last transfers there.
  local function total(lo, hi)
    if not newestE then
      return 0
    end
    local f
    if oldestE.score > lo then
      if oldestE.score > hi then
        return 0
      end
      f = oldestE
    else
      local r = redis.call('ZRANGEBYSCORE', KEYS[6], above(lo), upto(hi), 'LIMIT', '0', '1')
      if #r == 0 then
        return 0
      end
      f = must(parse(r[1]), r[1])
    end
    local l = newestE
    if newestE.score > hi then
      local r = redis.call('ZREVRANGEBYSCORE', KEYS[6], upto(hi), above(lo), 'LIMIT', '0', '1')
      l = must(parse(r[1]), r[1])
    end
    return l.cum - f.cum + f.amount
  end

  -- Reads first (an inconsistent window fails here, before any write).
  -- The sender's total over (at - window, at], this transfer included.
  local before = total(at - window, at)
  local windowTotal = amount + before
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
  local cumBefore, tie = 0, 0
  local later = {}
  if newestE and newestE.score <= at then
    cumBefore = newestE.cum -- in order: after the newest
    if newestE.score == at then
      tie = newestE.tie + 1
    end
  elseif newestE then
    local prev = redis.call('ZREVRANGEBYSCORE', KEYS[6], ARGV[6], '-inf', 'LIMIT', '0', '1')
    if #prev > 0 then
      local e = must(parse(prev[1]), prev[1])
      cumBefore = e.cum
      if e.score == at then
        tie = e.tie + 1
      end
    else
      cumBefore = oldestE.cum - oldestE.amount
    end
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[6], '(' .. ARGV[6], '+inf')) do
      table.insert(later, must(parse(m), m))
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
  -- transfer's amount.
  local revisions = {}
  if windowTotal > limit and before <= limit and newestE and newestE.score >= at then
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[6], ARGV[6], ARGV[6])) do
      local e = must(parse(m), m)
      if e.approved then
        table.insert(revisions, {e = e, total = windowTotal})
      end
    end
  end
  for _, e in ipairs(later) do
    if e.approved and e.score < at + window then
      local ltotal = amount + total(e.score - window, e.score)
      if ltotal > limit then
        table.insert(revisions, {e = e, total = ltotal})
      end
    end
  end
  -- What revising them takes, read now (a verdict key of the wrong type
  -- fails here, not after the writes): their current verdicts.
  for _, r in ipairs(revisions) do
    r.current = redis.call('GET', ARGV[18] .. r.e.transfer)
  end

  local newest, oldest = at, at
  if newestE then
    newest = math.max(newest, newestE.score)
    oldest = math.min(oldest, oldestE.score)
  end
  local trim = oldest < newest - 2 * window -- below, after the window's writes

  -- Keys written after the first non-idempotent write (the window's) must
  -- not fail mid-script: a wrong type would leave half an effect behind.
  -- Check those this event writes, before any write. The window itself was
  -- read above; the verdicts a revision rewrites too.
  local audit = tonumber(ARGV[20])
  local typed = {{KEYS[7], 'hash'}}
  if expireAt > 0 then
    table.insert(typed, {KEYS[3], 'hash'})
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
    redis.call('SET', KEYS[2], verdict, 'PXAT', ARGV[12])
    -- The day's senders and the days index change only with a new sender
    -- or day (their expiry and trim too: the same instant for every
    -- transfer of a day, and a new day at least once a day; a --retention
    -- changed in the middle of a day applies to the day keys created after).
    if redis.call('SADD', KEYS[4], ARGV[4]) == 1 then
      redis.call('PEXPIREAT', KEYS[4], ARGV[12])
    end
    if redis.call('ZADD', KEYS[5], ARGV[14], ARGV[13]) == 1 then
      redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', '(' .. ARGV[15])
    end
  end
  -- The window: the later transfers' running sums and the revised ones'
  -- flags, then this transfer.
  local changed = {}
  for _, e in ipairs(later) do
    e.cum = e.cum + amount
    changed[e.m] = e
  end
  for _, r in ipairs(revisions) do
    r.e.approved = false -- sent to review: it can change no more
    changed[r.e.m] = r.e
  end
  local gone, new = {}, {}
  for m, e in pairs(changed) do
    table.insert(gone, m)
    table.insert(new, upto(e.score))
    table.insert(new, member(e))
  end
  for i = 1, #gone, 1000 do
    redis.call('ZREM', KEYS[6], unpack(gone, i, math.min(i + 999, #gone)))
  end
  table.insert(new, ARGV[6])
  table.insert(new, member({score = at, tie = tie, cum = cumBefore + amount, amount = amount,
    approved = verdict == 'approve', event = ARGV[2], transfer = ARGV[3]}))
  zadd(new)
  -- Forget transfers older than the newest one seen minus two windows: events
  -- of one sender can arrive up to a window late and still be judged right.
  if trim then
    redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', above(newest - 2 * window))
  end
  -- The running sums only grow while the sender keeps sending: bring them
  -- back near zero long before they leave a double's exact integers.
  local first = {}
  if cumBefore + amount > 2 ^ 48 then
    first = redis.call('ZRANGE', KEYS[6], '0', '0')
  end
  if #first > 0 then
    local f = must(parse(first[1]), first[1])
    local base = f.cum - f.amount
    if base > 2 ^ 48 then
      local rebased = {}
      for _, m in ipairs(redis.call('ZRANGE', KEYS[6], '0', '-1')) do
        local e = must(parse(m), m)
        e.cum = e.cum - base
        table.insert(rebased, upto(e.score))
        table.insert(rebased, member(e))
      end
      redis.call('DEL', KEYS[6])
      zadd(rebased)
    end
  end
  redis.call('PEXPIRE', KEYS[6], ARGV[16])
  -- Then the counters, which must happen once.
  if expireAt > 0 then
    redis.call('HINCRBY', KEYS[3], 'sent_cents', ARGV[5])
    if redis.call('HINCRBY', KEYS[3], 'transfers', '1') == 1 then
      redis.call('PEXPIREAT', KEYS[3], ARGV[12]) -- the same instant for the whole day
    end
  end
  redis.call('HINCRBY', KEYS[7], 'verdicts', '1')
  if audit > 0 then
    redis.call('XADD', KEYS[11], 'MAXLEN', '~', ARGV[20], '*',
      'event_id', ARGV[2], 'transfer_id', ARGV[3], 'from_account', ARGV[4], 'verdict', verdict)
  end
  if verdict == 'review' then
    redis.call('HINCRBY', KEYS[7], 'reviews', '1')
    redis.call('XADD', KEYS[8], 'MINID', ARGV[17], '*',
      'event_id', ARGV[2], 'transfer_id', ARGV[3], 'from_account', ARGV[4],
      'to_account', ARGV[10], 'amount_cents', ARGV[5], 'currency', ARGV[11],
      'window_total_cents', string.format('%d', windowTotal), 'reason', reason)
  end
  -- Transfers this one pushes over the limit go to review.
  local revised = 0
  for _, r in ipairs(revisions) do
    if r.current == 'approve' then
      local e = r.e
      redis.call('SET', ARGV[18] .. e.transfer, 'review', 'KEEPTTL')
      redis.call('HINCRBY', KEYS[7], 'reviews', '1')
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
