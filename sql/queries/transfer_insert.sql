-- Insert a transfer; a transfer id seen before inserts nothing and returns no row.
INSERT INTO transfers (id, from_account, to_account, amount_cents, currency)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (id) DO NOTHING
RETURNING settled_at
