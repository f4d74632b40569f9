-- Whether no relay of ownership @mode holds its lock (relay_ownership_hold):
-- true when the exclusive lock could be taken; it is released with the
-- statement's own transaction at once. Relays claiming rows and relays
-- leasing partitions must never run side by side: a claimer's 'publishing'
-- row does not hold back an owner's read of the next event of its key, nor
-- an owner's lease a claimer's claim.
SELECT pg_try_advisory_xact_lock(1869903216, @mode)
