-- Record how many rows the cleanup run @id deleted (migration 0021).
UPDATE outbox_cleanups SET deleted = @deleted WHERE id = @id
