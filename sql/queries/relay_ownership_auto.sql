-- The ownership a relay of the default ownership (auto) runs, and why
-- (relay/ownership.go: resolveOwnership). The ownership of the relays alive
-- (their LISTEN backends holding their lock: outbox_live_relays), row claims
-- first. With no relay alive, row claims while anything says a row claimer
-- may still be running without its LISTEN connection, since a PostgreSQL
-- restart cuts every LISTEN connection while the claimers' pools go on
-- claiming: a row claimer's membership (relay_register.sql: no end, until
-- the relay stops or a live relay finds its backend gone), or a claim younger
-- than @lease_ms. Partition leases otherwise. A wrong "rows" costs only the
-- drain rate until every relay stops at once; a wrong "partitions" would
-- publish next to live claimers.
WITH seen AS (
    SELECT EXISTS (SELECT 1 FROM outbox_live_relays WHERE ownership = 1) AS claimers_alive,
           EXISTS (SELECT 1 FROM outbox_live_relays WHERE ownership = 2) AS owners_alive,
           EXISTS (SELECT 1 FROM outbox_relay_members
                    WHERE seen_until = 'infinity' AND pid IS NOT NULL) AS claimer_registered,
           EXISTS (SELECT 1 FROM outbox_messages
                    WHERE unpublished AND status = 'publishing'
                      AND claimed_at > now() - @lease_ms * interval '1 millisecond') AS recent_claim
)
SELECT CASE
         WHEN claimers_alive THEN 'rows'
         WHEN owners_alive THEN 'partitions'
         WHEN claimer_registered OR recent_claim THEN 'rows'
         ELSE 'partitions'
       END AS ownership,
       CASE
         WHEN claimers_alive OR owners_alive THEN 'the relays running'
         WHEN claimer_registered THEN 'a row claimer registered and not known gone'
         WHEN recent_claim THEN 'a claim younger than the lease'
         ELSE 'no relay running'
       END AS reason
  FROM seen
