-- The audit of what an operator did through the console (outbox console):
-- a dead event requeued (the same code as outbox dead retry) or a consumer's
-- dead letter put back on its stream (as outbox dlq retry). One row per
-- action that changed something, written right after it: who (as the person
-- typed it, and the address the request came from), when, why, and what.
-- Never updated. outbox_republished keeps outbox republish's own audit.
CREATE TABLE outbox_operator_actions (
    id      bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    actor   text        NOT NULL CHECK (length(actor) BETWEEN 1 AND 200),
    origin  text        NOT NULL DEFAULT '' CHECK (length(origin) <= 200),
    action  text        NOT NULL CHECK (action IN ('dead_retry', 'dlq_retry')),
    target  text        NOT NULL CHECK (length(target) BETWEEN 1 AND 500),
    reason  text        NOT NULL CHECK (length(reason) BETWEEN 1 AND 1000),
    outcome text        NOT NULL DEFAULT '' CHECK (length(outcome) <= 1000)
);
