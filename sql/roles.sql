-- Least-privilege roles for the outbox. Run once per database as its owner,
-- after `outbox migrate`, then give each role LOGIN and a password (or map
-- your own login roles into them with GRANT outbox_writer TO app_user):
--
--   psql "$DATABASE_URL" -f sql/roles.sql
--   ALTER ROLE outbox_writer LOGIN PASSWORD '...';   -- or GRANT ... TO your roles
--
-- outbox_writer: the business service. Inserts transfers and outbox rows
--   (and reads transfers back, to recognise a retried settlement). Of an
--   outbox row it writes only the event's own columns (id, aggregate,
--   event type, payload, headers, partition key), never its delivery state
--   (status, attempts, stamps) or its place in the order (seq); it cannot
--   change or delete a row once written.
-- outbox_relay:  the relay. Reads outbox rows and updates only their
--   delivery columns, never what was committed (payload, keys, seq); cannot
--   insert, delete, or touch transfers.
-- outbox_admin:  operators' commands (dead retry, cleanup): the relay's
--   rights plus DELETE.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_writer') THEN CREATE ROLE outbox_writer; END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_relay')  THEN CREATE ROLE outbox_relay;  END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_admin')  THEN CREATE ROLE outbox_admin;  END IF;
END
$$;

GRANT USAGE ON SCHEMA public TO outbox_writer, outbox_relay, outbox_admin;

GRANT SELECT, INSERT ON transfers TO outbox_writer;
-- Column by column. Revoked first: a database set up by an
-- earlier version of this file granted the whole rows.
REVOKE INSERT ON outbox_messages FROM outbox_writer;
GRANT INSERT (id, aggregate_type, aggregate_id, event_type, payload, headers, partition_key)
    ON outbox_messages TO outbox_writer;
GRANT SELECT (id, seq) ON outbox_messages TO outbox_writer; -- INSERT ... RETURNING id, seq
GRANT USAGE ON SEQUENCE outbox_messages_seq TO outbox_writer;
GRANT SELECT ON SEQUENCE outbox_relay_idle TO outbox_writer;   -- the notify trigger reads the idle flag

REVOKE UPDATE ON outbox_messages FROM outbox_relay;
GRANT SELECT ON outbox_messages TO outbox_relay;
GRANT UPDATE (status, attempts, claimed_at, claimed_by, claim_token, claimed_pid, next_attempt_at,
              published_at, stream_id, last_error, first_sent_at)
    ON outbox_messages TO outbox_relay;
GRANT SELECT, UPDATE ON SEQUENCE outbox_relay_idle TO outbox_relay; -- outbox_relay_busy/sleep set the flag
GRANT SELECT ON SEQUENCE outbox_messages_seq, outbox_relay_requeues TO outbox_relay; -- the read floor (migration 0019)
GRANT USAGE ON SEQUENCE outbox_relay_requeues TO outbox_relay;                     -- a requeue counts itself (0019)

GRANT outbox_relay TO outbox_admin;
GRANT DELETE ON outbox_messages TO outbox_admin;
-- outbox republish (migration 0017): the audit of what it put back.
GRANT SELECT, INSERT ON outbox_republished TO outbox_admin;
GRANT SELECT, INSERT ON outbox_operator_actions TO outbox_admin; -- the console's audit (0020)
GRANT SELECT, INSERT, UPDATE ON outbox_cleanups TO outbox_admin; -- cleanup's runs, reconcile's horizon (0021)

-- Partition leases (migration 0010), for relays with --ownership partitions.
GRANT SELECT, UPDATE ON outbox_relay_partitions TO outbox_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_relay_members TO outbox_relay;

-- Failover (migration 0012): relays find each other's LISTEN backends in
-- outbox_live_relays and record the last one that said "busy".
GRANT SELECT ON outbox_live_relays TO outbox_relay;
GRANT SELECT, UPDATE ON SEQUENCE outbox_relay_busy_pid TO outbox_relay;
