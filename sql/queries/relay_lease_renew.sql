-- Renew this relay's ($1) membership and the leases of the slots it holds,
-- for $2 milliseconds. A slot whose token is still this relay's is renewed
-- even if its lease ran out meanwhile: no other relay took it (taking a slot
-- changes its token), so nothing was published in between. Returns the slots
-- held, with their tokens.
WITH member AS (
    INSERT INTO outbox_relay_members (owner, seen_until)
    VALUES ($1, now() + $2 * interval '1 millisecond')
    ON CONFLICT (owner) DO UPDATE SET seen_until = excluded.seen_until
)
UPDATE outbox_relay_partitions
   SET lease_until = now() + $2 * interval '1 millisecond'
 WHERE owner = $1
RETURNING slot, token
