-- The entries of the transfers @transfer_ids: for reconciliation against the
-- transfers the outbox's database settled.
SELECT transfer_id, account, amount_cents
  FROM ledger_entries
 WHERE transfer_id = ANY(@transfer_ids::uuid[])
