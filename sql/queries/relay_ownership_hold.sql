-- Say, for as long as this session lasts, that a relay of ownership @mode
-- (1: row claims, 2: partition leases) runs on this database: a shared
-- session-level advisory lock, taken on the relay's LISTEN connection and
-- released by PostgreSQL the moment that connection closes (the relay died
-- or stopped). Namespace 1869903216 is the relays' own.
SELECT pg_advisory_lock_shared(1869903216, @mode)
