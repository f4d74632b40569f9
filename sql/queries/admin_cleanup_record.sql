-- Record a run of outbox cleanup that deletes rows published before @cutoff
-- (migration 0021), before it deletes any: its id, for admin_cleanup_done.sql.
INSERT INTO outbox_cleanups (cutoff) VALUES (@cutoff) RETURNING id
