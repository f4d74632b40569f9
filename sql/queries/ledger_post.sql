-- Post the double entries of settled TEDs, a consumer's batch in one statement
-- (one round trip): for each i, @amount_cents[i] debited from
-- @from_accounts[i] and credited to @to_accounts[i], both under
-- @transfer_ids[i] and @event_ids[i], in the arrays' order.
INSERT INTO ledger_entries (transfer_id, event_id, account, amount_cents, currency, settled_at)
SELECT t.transfer_id, t.event_id, side.account, side.amount_cents, t.currency, t.settled_at
  FROM unnest(@transfer_ids::uuid[], @event_ids::uuid[], @from_accounts::text[], @to_accounts::text[],
              @amount_cents::bigint[], @currencies::text[], @settled_ats::timestamptz[])
         WITH ORDINALITY AS t(transfer_id, event_id, from_account, to_account, amount_cents, currency, settled_at, n)
 CROSS JOIN LATERAL (VALUES (1, t.from_account, -t.amount_cents), (2, t.to_account, t.amount_cents))
         AS side(k, account, amount_cents)
 ORDER BY t.n, side.k
