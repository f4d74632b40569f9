-- The runs of outbox cleanup (package admin, Cleanup): when each ran, its
-- cutoff (rows published before it are deleted) and how many it deleted.
-- A run records its cutoff before it deletes anything, and its count when
-- it ends (a run that died keeps 0). outbox reconcile reads the latest
-- cutoff, the cleanup horizon: a transfer settled before it may have had
-- its event deleted, which is retention, not a writer that bypassed
-- transfer.Settle.
CREATE TABLE outbox_cleanups (
    id      bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    ran_at  timestamptz NOT NULL DEFAULT now(),
    cutoff  timestamptz NOT NULL,
    deleted bigint      NOT NULL DEFAULT 0 CHECK (deleted >= 0)
);
