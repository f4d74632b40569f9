-- How many slots there are and how many relays are alive (this one included:
-- its membership was renewed earlier in the transaction); each relay takes
-- its share, the number of slots divided by the relays, rounded up. A member
-- whose LISTEN backend is gone is not counted (migration 0012). Members
-- gone for a minute are deleted on the way.
WITH gone AS (
    DELETE FROM outbox_relay_members WHERE seen_until < now() - interval '1 minute'
)
SELECT (SELECT count(*) FROM outbox_relay_partitions)::int AS slots,
       (SELECT count(*)
          FROM outbox_relay_members
         WHERE seen_until > now()
           AND (pid IS NULL OR pid IN (SELECT pid FROM outbox_live_relays)))::int AS relays
