-- The last @max_rows operators' actions (migration 0020), newest first.
SELECT id, at, actor, origin, action, target, reason, outcome
  FROM outbox_operator_actions
 ORDER BY id DESC
 LIMIT @max_rows::bigint
