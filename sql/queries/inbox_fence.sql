-- Check, in the transaction that applies a batch, that the partition
-- @partition of @consumer_group has no owner newer than the lease epoch @epoch
-- (raising the stored epoch to it if it is older): returns a row if so, none
-- if a newer owner took the partition. The row lock it takes orders the
-- owners' transactions.
INSERT INTO consumer_fences AS f (consumer_group, partition, epoch)
VALUES (@consumer_group, @partition, @epoch)
    ON CONFLICT (consumer_group, partition) DO UPDATE
   SET epoch = excluded.epoch
 WHERE f.epoch <= excluded.epoch
RETURNING f.epoch
