-- The relay starts draining: writers need not notify until it sleeps again
-- (sql/migrations/0006_outbox_notify_idle.sql). @pid, the relay's LISTEN
-- backend, is recorded as the relay that said it: should it die before it
-- says "sleep", the other relays say it for it (migration 0012).
SELECT outbox_relay_busy(@pid::int)
