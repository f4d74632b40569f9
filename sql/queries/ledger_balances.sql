-- Every account's balance (the sum of its entries) and how many entries it
-- has, by account.
SELECT account, sum(amount_cents)::bigint AS balance_cents, count(*) AS entries
  FROM ledger_entries
 GROUP BY account
 ORDER BY account
