-- Move one dead-letter entry back to its source stream, atomically: re-add its
-- original fields (every field but the dlq_* ones that fraud/deadletter.lua
-- appended) under a new id, then delete it from the dead-letter stream.
--
-- KEYS[1] dead-letter stream  KEYS[2] source stream
-- ARGV[1] dead-letter entry id
-- ARGV[2] source stream of an entry without a dlq_stream field
-- Returns the new entry id, or nil if the dead letter is gone (already
-- retried, or deleted). Errors, leaving the dead letter in place, when its
-- source stream is not KEYS[2] or it has no original fields.
local entry = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])[1]
if not entry then
  return false
end
local source, fields = ARGV[2], {}
local f = entry[2]
for i = 1, #f, 2 do
  if f[i] == 'dlq_stream' then
    source = f[i + 1]
  elseif string.sub(f[i], 1, 4) ~= 'dlq_' then
    table.insert(fields, f[i])
    table.insert(fields, f[i + 1])
  end
end
if source ~= KEYS[2] then
  return redis.error_reply('ERR dead letter ' .. ARGV[1] .. ' comes from stream ' .. source .. ', not ' .. KEYS[2])
end
if #fields == 0 then
  return redis.error_reply('ERR dead letter ' .. ARGV[1] .. ' has no original fields (the entry was trimmed before it was dead-lettered)')
end
local id = redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('XDEL', KEYS[1], ARGV[1])
return id
