-- 0002 serialized writers of one aggregate with a transaction-scoped advisory
-- lock per inserted row. A transaction inserting many aggregates at once (a
-- bulk load of 50,000 events) then needs one lock-table slot per aggregate and
-- fails with "out of shared memory" (measured with scripts/measure-retention.sh).
-- Per-aggregate order is kept by the relay's claim (seq order, one event per
-- aggregate in flight); writers of one aggregate must serialize themselves, as
-- any transaction that changes the aggregate's own row already does.
DROP TRIGGER outbox_messages_order ON outbox_messages;
DROP FUNCTION outbox_messages_order();
