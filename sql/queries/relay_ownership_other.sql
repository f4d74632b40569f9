-- Whether no relay of ownership @mode holds its lock (relay_ownership_hold)
-- on this database. It reads pg_locks rather than trying the lock: two
-- relays of one ownership checking at the same moment must not mistake each
-- other's attempt for a relay of the other kind. Relays claiming rows and
-- relays leasing partitions must never run side by side: a claimer's
-- 'publishing' row does not hold back an owner's read of the next event of
-- its key, nor an owner's lease a claimer's claim. Only a registered relay
-- counts (outbox_relay_members, which only the relays' role may write): any
-- role may take an advisory lock (migration 0018). A relay registers before
-- it looks, so two relays of different ownerships starting at once see each
-- other.
SELECT NOT EXISTS (
    SELECT 1
      FROM pg_locks
     WHERE locktype = 'advisory'
       AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND classid = 1869903216
       AND objid = @mode::int
       AND objsubid = 2
       AND granted
       AND pid IN (SELECT pid FROM outbox_relay_members WHERE pid IS NOT NULL))
