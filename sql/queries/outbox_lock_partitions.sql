-- Serialize the writers of the partition keys a Write is about to insert:
-- take the transaction-scoped advisory lock of each lock slot @lock_slots (distinct,
-- ascending, so two writers never wait for each other in a cycle), held until
-- the transaction ends. Two transactions writing one partition key then
-- insert in the order they commit, so seq order is commit order per key and
-- the relay publishes a key's events in the order they were committed.
--
-- Slots, not keys: a slot is partition.Of(aggregate_type/partition key, 256)
-- (outbox.go), so a transaction takes at most 256 lock-table entries however
-- many keys it writes (one per key exhausted the lock table on bulk inserts:
-- migration 0005). Writers of different keys share a slot 1 time in 256 and
-- then wait for each other's commit. Class 1869903215 keeps the locks apart
-- from the application's own single-key advisory locks and from the wake-up
-- lock (1869903214, migration 0006).
SELECT count(pg_advisory_xact_lock(1869903215, s))
  FROM unnest(@lock_slots::int[]) AS s
