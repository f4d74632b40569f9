-- The cleanup horizon (migration 0021): the latest cutoff of an outbox
-- cleanup run; NULL when none deleted anything. An event published before
-- it may have been deleted.
SELECT max(cutoff) FROM outbox_cleanups
