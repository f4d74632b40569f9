-- Every transfer of the given senders, through the index
-- transfers_from_account_settled_at: their anti-fraud totals are compared
-- with the sums over these rows.
--
-- @senders from_accounts (text[]).
SELECT from_account, id::text AS transfer_id, amount_cents
  FROM transfers
 WHERE from_account = ANY(@senders)
