-- Post a settled TED's double entry: @amount_cents debited from @from_account
-- and credited to @to_account, both under @transfer_id and @event_id.
INSERT INTO ledger_entries (transfer_id, event_id, account, amount_cents, currency, settled_at)
VALUES (@transfer_id, @event_id, @from_account, -@amount_cents::bigint, @currency, @settled_at),
       (@transfer_id, @event_id, @to_account, @amount_cents::bigint, @currency, @settled_at)
