-- Settled TEDs. One row per transfer; the id is chosen by the caller so that a
-- retried settlement is recognised (ON CONFLICT (id) DO NOTHING).
CREATE TABLE transfers (
    id           uuid        PRIMARY KEY,
    from_account text        NOT NULL,
    to_account   text        NOT NULL,
    amount_cents bigint      NOT NULL,
    currency     text        NOT NULL DEFAULT 'BRL',
    settled_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT transfers_amount_positive  CHECK (amount_cents > 0),
    CONSTRAINT transfers_from_account_set CHECK (length(btrim(from_account)) BETWEEN 1 AND 64),
    CONSTRAINT transfers_to_account_set   CHECK (length(btrim(to_account)) BETWEEN 1 AND 64),
    CONSTRAINT transfers_distinct_accounts CHECK (from_account <> to_account),
    CONSTRAINT transfers_currency_iso     CHECK (currency ~ '^[A-Z]{3}$')
);

CREATE INDEX transfers_from_account_settled_at ON transfers (from_account, settled_at);
