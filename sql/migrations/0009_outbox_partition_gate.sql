-- The claim's gate orders by partition key instead of aggregate.
--
-- A claim takes an event only when no older event of the same aggregate type
-- and partition key is still unpublished (relay_claim.sql). This index is
-- the gate's lookup: coalesce(partition_key, aggregate_id) is the partition
-- key, NULL meaning the aggregate id (migration 0008). For events written
-- without a partition key nothing changes: their partition key is their
-- aggregate id, as the gate keyed them before.
--
-- The index covers only unpublished rows, so building it reads the table
-- once but writes little; the old per-aggregate gate index goes.
CREATE INDEX outbox_messages_unpublished_by_partition
    ON outbox_messages (aggregate_type, (coalesce(partition_key, aggregate_id)), seq) WHERE unpublished;

DROP INDEX outbox_messages_unpublished_by_aggregate;
