-- A relay's LISTEN connection came back (a new backend, this session): its
-- claims made under its earlier LISTEN backends @past_pids are stamped with
-- this one's pid, so that the relays do not take them for a dead relay's
-- (migration 0012). Run on the LISTEN connection, after relay_register.sql.
UPDATE outbox_messages
   SET claimed_pid = pg_backend_pid()
 WHERE unpublished
   AND status = 'publishing'
   AND claimed_pid = ANY(@past_pids::int[])
