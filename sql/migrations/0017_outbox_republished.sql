-- Repair: the audit of events republished by an operator.
--
-- A Redis that loses entries it acknowledged (restarted without an
-- append-only file, a failover to a replica that did not have them) leaves
-- events that PostgreSQL says are published and no consumer will ever see:
-- outbox reconcile reports them (not_in_stream). outbox republish (package
-- admin, Republish) puts such events back to pending, so that the relays
-- publish them again, and records here who did it, when, why, and the entry
-- the event had. One row per event republished; never updated.
CREATE TABLE outbox_republished (
    event_id              uuid        NOT NULL,
    republished_at        timestamptz NOT NULL DEFAULT now(),
    republished_by        text        NOT NULL CHECK (length(republished_by) BETWEEN 1 AND 200),
    reason                text        NOT NULL CHECK (length(reason) BETWEEN 1 AND 1000),
    previous_stream_id    text,
    previous_published_at timestamptz
);

CREATE INDEX outbox_republished_event ON outbox_republished (event_id);
