-- Failover without waiting for a lease.
--
-- A relay's LISTEN connection holds its ownership lock for as long as the
-- relay lives (relay_ownership_hold: a shared session-level advisory lock,
-- namespace 1869903216). PostgreSQL releases it the moment that connection's
-- backend exits: the relay was killed or stopped, or its link went half-open
-- and the server's TCP keepalives, which the relay sets on that connection,
-- gave up on it. While the relay lives, that backend's pid names it
-- (outbox_live_relays). A relay records the pid:
--
--   - in its row of outbox_relay_members (pid), whatever its ownership;
--   - in each row it claims (outbox_messages.claimed_pid) and each slot it
--     leases (outbox_relay_partitions.owner_pid);
--   - as the last relay that told writers it is busy (outbox_relay_busy_pid).
--
-- The other relays look for members whose pid no longer holds the lock
-- several times a second (relay_watch.sql), and then at once return the dead
-- relay's claims to pending (relay_reap.sql), free its slots
-- (relay_bury.sql) and, if it was the one that silenced the writers, tell
-- writers to notify again. A claim or a slot with no pid (taken while its
-- relay's LISTEN connection was down) and a relay that stalled with its
-- connections open (a paused process) still wait for the lease, as before:
-- the database cannot see those.
--
-- A pid is reused only after its backend exited; a claim whose pid a later
-- relay's LISTEN backend happens to reuse waits for its lease.

ALTER TABLE outbox_messages ADD COLUMN claimed_pid int;
ALTER TABLE outbox_relay_members ADD COLUMN pid int;
ALTER TABLE outbox_relay_partitions ADD COLUMN owner_pid int;

-- The pid of the relay that said "busy" last (0: none yet). Like the idle
-- flag, a sequence: set without a transaction, read by every relay.
CREATE SEQUENCE outbox_relay_busy_pid AS int MINVALUE 0 START 0;

-- The relays alive on this database: the backends holding an ownership lock
-- (ownership 1: row claims, 2: partition leases).
CREATE VIEW outbox_live_relays AS
SELECT l.pid, l.objid::int AS ownership
  FROM pg_locks l
 WHERE l.locktype = 'advisory'
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND l.classid = 1869903216
   AND l.objsubid = 2
   AND l.granted;

-- "Busy", said by the relay whose LISTEN backend is relay_pid: the pid
-- first, so that a relay reading the flag as 0 finds the pid of a relay
-- that said it.
CREATE FUNCTION outbox_relay_busy(relay_pid int) RETURNS void
LANGUAGE sql AS $$
    SELECT setval('outbox_relay_busy_pid', greatest(relay_pid, 0));
    SELECT setval('outbox_relay_idle', 0);
$$;
