-- The ledger example's own table (package ledger), in its own database: a
-- double entry per settled TED, a debit (negative) on the sender's account
-- and a credit on the receiver's, posted by a consumer in the transaction
-- that records the event in its inbox (sql/inbox). Entries are only ever
-- inserted: a balance is the sum of an account's entries, so concurrent
-- postings never wait for each other's row locks.
CREATE TABLE ledger_entries (
    entry_id     bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    transfer_id  uuid        NOT NULL,
    event_id     uuid        NOT NULL,
    account      text        NOT NULL,
    amount_cents bigint      NOT NULL CHECK (amount_cents <> 0),
    currency     text        NOT NULL,
    settled_at   timestamptz NOT NULL,
    posted_at    timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX ledger_entries_account ON ledger_entries (account);
CREATE INDEX ledger_entries_transfer ON ledger_entries (transfer_id);
