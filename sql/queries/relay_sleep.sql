-- The relay is about to sleep: wait for the writers that read "busy", then ask
-- writers to notify (sql/migrations/0006_outbox_notify_idle.sql). The relay
-- claims once more after this, so nothing committed meanwhile waits for a poll.
SELECT outbox_relay_sleep()
