-- Renew this relay's (@relay) membership and the leases of the slots it holds,
-- for @lease_ms milliseconds. A slot whose token is still this relay's is renewed
-- even if its lease ran out meanwhile: no other relay took it (taking a slot
-- changes its token), so nothing was published in between. With @rotate, the
-- relay has just started: it takes back at once the slots a previous process
-- of the same name held (killed, its leases not yet run out), each with a new
-- token, so that the previous process, were it still alive, marks nothing.
-- @pid is the relay's LISTEN backend (0: its LISTEN connection is down), in
-- its membership and its slots: the other relays take them the moment that
-- backend is gone (migration 0012). Returns the slots held, with their tokens.
WITH member AS (
    INSERT INTO outbox_relay_members (owner, seen_until, pid)
    VALUES (@relay, now() + @lease_ms * interval '1 millisecond', nullif(@pid::int, 0))
    ON CONFLICT (owner) DO UPDATE SET seen_until = excluded.seen_until, pid = excluded.pid
)
UPDATE outbox_relay_partitions
   SET lease_until = now() + @lease_ms * interval '1 millisecond',
       token = CASE WHEN @rotate::boolean THEN gen_random_uuid() ELSE token END,
       owner_pid = nullif(@pid::int, 0)
 WHERE owner = @relay
RETURNING slot, token
