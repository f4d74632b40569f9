-- Record an operator's action (migration 0020): @actor did @action to
-- @target for @reason, from @origin, with @outcome. Returns the record's id
-- and time.
INSERT INTO outbox_operator_actions (actor, origin, action, target, reason, outcome)
VALUES (@actor, @origin, @action, @target, @reason, @outcome)
RETURNING id, at
