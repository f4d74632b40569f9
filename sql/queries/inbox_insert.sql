-- Record the events @event_ids as processed by @consumer_group, in the
-- transaction that applies their effects; returns the ids that were not
-- recorded yet (the others are duplicates: their effect is already applied).
INSERT INTO consumer_inbox (consumer_group, event_id)
SELECT @consumer_group, id
  FROM unnest(@event_ids::uuid[]) AS id
    ON CONFLICT DO NOTHING
RETURNING event_id
