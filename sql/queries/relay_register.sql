-- Say that relay @relay lives as the backend of this connection: its LISTEN
-- connection, which holds its ownership lock. The other relays find the relay
-- dead the moment that backend exits (migration 0012). A partition owner's
-- membership also lasts @lease_ms and is renewed with its leases; a row
-- claimer's (@lease_ms 0) ends only with its backend, or when it stops.
-- A previous process of the same name is replaced: its claims are returned
-- by the reaper (their pid is dead), its slots taken back by the first renewal.
INSERT INTO outbox_relay_members (owner, seen_until, pid)
VALUES (@relay,
        CASE WHEN @lease_ms::bigint > 0 THEN now() + @lease_ms * interval '1 millisecond' ELSE 'infinity' END,
        pg_backend_pid())
ON CONFLICT (owner) DO UPDATE
   SET pid = excluded.pid,
       seen_until = greatest(outbox_relay_members.seen_until, excluded.seen_until)
RETURNING pid
