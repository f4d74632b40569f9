-- Dead rows are few and looked at by operators and metrics: index them so
-- counting them never scans the published rows.
CREATE INDEX outbox_messages_dead ON outbox_messages (seq) WHERE status = 'dead';
