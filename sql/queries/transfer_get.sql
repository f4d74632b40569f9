SELECT from_account, to_account, amount_cents, currency, settled_at
  FROM transfers
 WHERE id = @id
