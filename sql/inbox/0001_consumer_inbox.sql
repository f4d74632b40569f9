-- The inbox of the consumers that keep their state in PostgreSQL (package
-- consumer/inbox): in the consumer's own database, which may or may not be
-- the outbox's. An event's effect commits in one transaction with its row
-- here, so a redelivery finds the row and is skipped: the effect is applied
-- exactly once however often the event is delivered.
CREATE TABLE consumer_inbox (
    consumer_group text        NOT NULL,
    event_id       uuid        NOT NULL,
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, event_id)
);

-- The retention's cleanup deletes the oldest rows of a group first.
CREATE INDEX consumer_inbox_processed_at ON consumer_inbox (consumer_group, processed_at);

-- The fencing tokens of the partitions' owners (consumer/ownership.go): each
-- transaction of an owner raises its partition's epoch to its own lease's, or
-- finds a greater one (a newer owner) and is refused. The row lock orders the
-- old owner's last transaction before the new owner's first.
CREATE TABLE consumer_fences (
    consumer_group text   NOT NULL,
    partition      int    NOT NULL,
    epoch          bigint NOT NULL,
    PRIMARY KEY (consumer_group, partition)
);
