-- Every transfer settled since @since with its transfer.settled event, if any,
-- and every such event since @since with its transfer, if any: one pass over each
-- table (a hash join), streamed to the caller, so that millions of rows cost
-- seconds and bounded memory. It reads a snapshot and takes no lock that a
-- writer or a relay waits for. Events are matched by aggregate id, the
-- transfer id (transfer.SettleTx writes it so); partition_key is the key the
-- relay chose the event's stream partition by.
--
-- @since since: transfers settled and events created at or after it.
SELECT t.id::text        AS transfer_id,
       t.from_account    AS from_account,
       t.to_account      AS to_account,
       t.amount_cents    AS amount_cents,
       t.settled_at      AS settled_at,
       e.id::text        AS event_id,
       e.aggregate_id    AS event_aggregate_id,
       e.status          AS status,
       e.created_at      AS created_at,
       e.stream_id       AS stream_id,
       coalesce(e.partition_key, e.aggregate_id) AS partition_key
  FROM (SELECT id, from_account, to_account, amount_cents, settled_at FROM transfers WHERE settled_at >= @since) t
  FULL JOIN (SELECT id, aggregate_id, status, created_at, stream_id, partition_key
               FROM outbox_messages
              WHERE aggregate_type = 'transfer' AND event_type = 'transfer.settled'
                AND created_at >= @since) e
    ON e.aggregate_id = t.id::text
