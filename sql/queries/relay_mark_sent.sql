-- A publish that may have reached the broker without being marked (a reply
-- that timed out, replicas that did not confirm) starts its rows' redelivery
-- window (migration 0011), unless it had started: before a claimer gives the
-- rows back (relay_release), and for a partition owner, which only read them.
UPDATE outbox_messages
   SET first_sent_at = now()
 WHERE id = ANY(@ids::uuid[])
   AND unpublished
   AND first_sent_at IS NULL
