-- outbox settle --plain-sql: settle a TED as a service without this
-- project's Go packages would (database/sql, another language), following
-- the README: the transfer row and its transfer.settled event in one
-- statement (one transaction), the event with no partition_key (migration
-- 0015 keys it by its sender and orders it among the sender's events). The
-- payload is the transfer.settled contract (transfer/settled); its event_id
-- is the row's id. Returns nothing when the transfer id exists.
WITH t AS (
    INSERT INTO transfers (id, from_account, to_account, amount_cents)
    VALUES (@id, @from_account, @to_account, @amount_cents)
    ON CONFLICT (id) DO NOTHING
    RETURNING id, from_account, to_account, amount_cents, currency, settled_at
)
INSERT INTO outbox_messages (id, aggregate_type, aggregate_id, event_type, payload, headers)
SELECT @event_id, 'transfer', t.id::text, 'transfer.settled',
       jsonb_build_object('schema_version', 1, 'event_id', @event_id::uuid, 'transfer_id', t.id,
                          'from_account', t.from_account, 'to_account', t.to_account,
                          'amount_cents', t.amount_cents, 'currency', t.currency,
                          'settled_at', t.settled_at),
       '{"schema_version": "1"}'
  FROM t
RETURNING id
