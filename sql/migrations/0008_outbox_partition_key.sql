-- Every outbox row has a partition key: the unit of order downstream. Events
-- with one partition key are meant to reach consumers in the order they were
-- written (the partitioned streams and the ordered relays are built on it);
-- for transfer.settled it is the sender account, so that one sender's TEDs
-- are judged in settled order.
--
-- NULL means the aggregate id, so a plain INSERT with only the four required
-- columns keeps working, and adding the column is instant on a table of any
-- size (no default to write into existing rows, no rewrite). Readers use
-- coalesce(partition_key, aggregate_id). The CHECK is NOT VALID: existing
-- rows are all NULL, and validating would scan the table under lock; new and
-- updated rows are checked.
ALTER TABLE outbox_messages ADD COLUMN partition_key text;
ALTER TABLE outbox_messages ADD CONSTRAINT outbox_messages_partition_key_set
    CHECK (partition_key IS NULL OR length(partition_key) BETWEEN 1 AND 200) NOT VALID;
