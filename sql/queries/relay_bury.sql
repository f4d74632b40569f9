-- The relays that died (relay_watch.sql): end their memberships and free the
-- partition slots they leased, so that the live relays' shares grow and they
-- take the slots at their next renewal (the caller wakes them). Returns the
-- names of the dead relays and how many slots were freed. Their claimed rows
-- go back to pending with relay_reap.sql.
WITH dead AS (
    DELETE FROM outbox_relay_members m
     WHERE m.pid IS NOT NULL
       AND m.pid NOT IN (SELECT pid FROM outbox_live_relays)
    RETURNING m.owner
), freed AS (
    UPDATE outbox_relay_partitions p
       SET owner = NULL,
           token = NULL,
           owner_pid = NULL,
           lease_until = '-infinity'
     WHERE p.owner_pid IS NOT NULL
       AND p.owner_pid NOT IN (SELECT pid FROM outbox_live_relays)
    RETURNING p.slot
)
SELECT coalesce((SELECT array_agg(owner ORDER BY owner) FROM dead), '{}')::text[] AS relays,
       (SELECT count(*) FROM freed)::int AS slots
