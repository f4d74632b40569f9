package outboxsql

// The queries, one per file of queries/ (each file's comment says what it
// does and what its parameters are), read when the package is initialized:
// a missing file stops the program at start, before any work, and a
// misspelt name does not compile.
var (
	AdminCleanup             = load("admin_cleanup")
	AdminCleanupCutoff       = load("admin_cleanup_cutoff")
	AdminDeadList            = load("admin_dead_list")
	AdminDeadRetry           = load("admin_dead_retry")
	AdminDeadRetryAll        = load("admin_dead_retry_all")
	MetricsOutbox            = load("metrics_outbox")
	OutboxInsert             = load("outbox_insert")
	OutboxLockPartitions     = load("outbox_lock_partitions")
	ReconcileEvents          = load("reconcile_events")
	ReconcileSenderTransfers = load("reconcile_sender_transfers")
	RelayBusy                = load("relay_busy")
	RelayClaim               = load("relay_claim")
	RelayLeaseAcquire        = load("relay_lease_acquire")
	RelayLeaseLeave          = load("relay_lease_leave")
	RelayLeaseRelease        = load("relay_lease_release")
	RelayLeaseRenew          = load("relay_lease_renew")
	RelayLeaseShare          = load("relay_lease_share")
	RelayMarkFailed          = load("relay_mark_failed")
	RelayMarkFailedLeased    = load("relay_mark_failed_leased")
	RelayMarkPublished       = load("relay_mark_published")
	RelayMarkPublishedLeased = load("relay_mark_published_leased")
	RelayNotify              = load("relay_notify")
	RelayRead                = load("relay_read")
	RelayReap                = load("relay_reap")
	RelayRelease             = load("relay_release")
	RelaySleep               = load("relay_sleep")
	Status                   = load("status")
	StatusListeningRelays    = load("status_listening_relays")
	StatusRelaySlots         = load("status_relay_slots")
	TransferGet              = load("transfer_get")
	TransferInsert           = load("transfer_insert")
)
