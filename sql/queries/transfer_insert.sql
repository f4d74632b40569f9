-- Insert a transfer; a transfer id seen before inserts nothing and returns no row.
INSERT INTO transfers (id, from_account, to_account, amount_cents, currency)
VALUES (@id, @from_account, @to_account, @amount_cents, @currency)
ON CONFLICT (id) DO NOTHING
RETURNING settled_at
