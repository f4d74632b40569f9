-- The relay starts draining: writers need not notify until it sleeps again
-- (sql/migrations/0006_outbox_notify_idle.sql).
SELECT outbox_relay_busy()
