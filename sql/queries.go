package outboxsql

import (
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// A Statement is one query of queries/ with its arguments, for Exec, Query,
// QueryRow or a pgx.Batch: pool.Exec(ctx, s.SQL, s.Args). The functions
// below build one per query, with the query's named parameters (@name) as
// typed Go parameters; Args are pgx.StrictNamedArgs, so a parameter missing
// from the SQL or the SQL's that was not given fails the statement.
type Statement struct {
	SQL  string
	Args pgx.StrictNamedArgs
}

// The query texts, read when the package is initialized: a missing file
// stops the program at start, before any work. Each file's comment says what
// the query does and what its parameters are.
var (
	adminCleanupSQL             = load("admin_cleanup")
	adminCleanupCutoffSQL       = load("admin_cleanup_cutoff")
	adminDeadListSQL            = load("admin_dead_list")
	adminDeadRetrySQL           = load("admin_dead_retry")
	adminDeadRetryAllSQL        = load("admin_dead_retry_all")
	metricsOutboxSQL            = load("metrics_outbox")
	outboxInsertSQL             = load("outbox_insert")
	outboxLockPartitionsSQL     = load("outbox_lock_partitions")
	reconcileEventsSQL          = load("reconcile_events")
	reconcileSenderTransfersSQL = load("reconcile_sender_transfers")
	relayBusySQL                = load("relay_busy")
	relayClaimSQL               = load("relay_claim")
	relayLeaseAcquireSQL        = load("relay_lease_acquire")
	relayLeaseLeaveSQL          = load("relay_lease_leave")
	relayLeaseReleaseSQL        = load("relay_lease_release")
	relayLeaseRenewSQL          = load("relay_lease_renew")
	relayLeaseShareSQL          = load("relay_lease_share")
	relayMarkFailedSQL          = load("relay_mark_failed")
	relayMarkFailedLeasedSQL    = load("relay_mark_failed_leased")
	relayMarkPublishedSQL       = load("relay_mark_published")
	relayMarkPublishedLeasedSQL = load("relay_mark_published_leased")
	relayNotifySQL              = load("relay_notify")
	relayReadSQL                = load("relay_read")
	relayReapSQL                = load("relay_reap")
	relayReleaseSQL             = load("relay_release")
	relaySleepSQL               = load("relay_sleep")
	statusSQL                   = load("status")
	statusListeningRelaysSQL    = load("status_listening_relays")
	statusRelaySlotsSQL         = load("status_relay_slots")
	transferGetSQL              = load("transfer_get")
	transferInsertSQL           = load("transfer_insert")
)

// AdminCleanup is queries/admin_cleanup.sql.
func AdminCleanup(before time.Time, afterSeq int64, batch int64) Statement {
	return Statement{adminCleanupSQL, pgx.StrictNamedArgs{"before": before, "after_seq": afterSeq, "batch": batch}}
}

// AdminCleanupCutoff is queries/admin_cleanup_cutoff.sql.
func AdminCleanupCutoff(olderThanUS int64) Statement {
	return Statement{adminCleanupCutoffSQL, pgx.StrictNamedArgs{"older_than_us": olderThanUS}}
}

// AdminDeadList is queries/admin_dead_list.sql.
func AdminDeadList(maxRows int64) Statement {
	return Statement{adminDeadListSQL, pgx.StrictNamedArgs{"max_rows": maxRows}}
}

// AdminDeadRetry is queries/admin_dead_retry.sql.
func AdminDeadRetry(ids []uuid.UUID) Statement {
	return Statement{adminDeadRetrySQL, pgx.StrictNamedArgs{"ids": ids}}
}

// AdminDeadRetryAll is queries/admin_dead_retry_all.sql.
func AdminDeadRetryAll(afterSeq int64, batch int64) Statement {
	return Statement{adminDeadRetryAllSQL, pgx.StrictNamedArgs{"after_seq": afterSeq, "batch": batch}}
}

// MetricsOutbox is queries/metrics_outbox.sql.
func MetricsOutbox() Statement {
	return Statement{metricsOutboxSQL, nil}
}

// OutboxInsert is queries/outbox_insert.sql.
func OutboxInsert(ids []uuid.UUID, aggregateTypes []string, aggregateIDs []string, eventTypes []string, payloads []string, headers []string, partitionKeys []string) Statement {
	return Statement{outboxInsertSQL, pgx.StrictNamedArgs{"ids": ids, "aggregate_types": aggregateTypes, "aggregate_ids": aggregateIDs, "event_types": eventTypes, "payloads": payloads, "headers": headers, "partition_keys": partitionKeys}}
}

// OutboxLockPartitions is queries/outbox_lock_partitions.sql.
func OutboxLockPartitions(lockSlots []int32) Statement {
	return Statement{outboxLockPartitionsSQL, pgx.StrictNamedArgs{"lock_slots": lockSlots}}
}

// ReconcileEvents is queries/reconcile_events.sql.
func ReconcileEvents(since time.Time) Statement {
	return Statement{reconcileEventsSQL, pgx.StrictNamedArgs{"since": since}}
}

// ReconcileSenderTransfers is queries/reconcile_sender_transfers.sql.
func ReconcileSenderTransfers(senders []string) Statement {
	return Statement{reconcileSenderTransfersSQL, pgx.StrictNamedArgs{"senders": senders}}
}

// RelayBusy is queries/relay_busy.sql.
func RelayBusy() Statement {
	return Statement{relayBusySQL, nil}
}

// RelayClaim is queries/relay_claim.sql.
func RelayClaim(batch int, token uuid.UUID, relay string) Statement {
	return Statement{relayClaimSQL, pgx.StrictNamedArgs{"batch": batch, "token": token, "relay": relay}}
}

// RelayLeaseAcquire is queries/relay_lease_acquire.sql.
func RelayLeaseAcquire(relay string, leaseMS int64, n int) Statement {
	return Statement{relayLeaseAcquireSQL, pgx.StrictNamedArgs{"relay": relay, "lease_ms": leaseMS, "count": n}}
}

// RelayLeaseLeave is queries/relay_lease_leave.sql.
func RelayLeaseLeave(relay string) Statement {
	return Statement{relayLeaseLeaveSQL, pgx.StrictNamedArgs{"relay": relay}}
}

// RelayLeaseRelease is queries/relay_lease_release.sql.
func RelayLeaseRelease(relay string, slots []int) Statement {
	return Statement{relayLeaseReleaseSQL, pgx.StrictNamedArgs{"relay": relay, "slots": slots}}
}

// RelayLeaseRenew is queries/relay_lease_renew.sql.
func RelayLeaseRenew(relay string, leaseMS int64, rotate bool) Statement {
	return Statement{relayLeaseRenewSQL, pgx.StrictNamedArgs{"relay": relay, "lease_ms": leaseMS, "rotate": rotate}}
}

// RelayLeaseShare is queries/relay_lease_share.sql.
func RelayLeaseShare() Statement {
	return Statement{relayLeaseShareSQL, nil}
}

// RelayMarkFailed is queries/relay_mark_failed.sql.
func RelayMarkFailed(ids []uuid.UUID, errs []string, backoffsMS []int64, token uuid.UUID, maxAttempts int) Statement {
	return Statement{relayMarkFailedSQL, pgx.StrictNamedArgs{"ids": ids, "errors": errs, "backoffs_ms": backoffsMS, "token": token, "max_attempts": maxAttempts}}
}

// RelayMarkFailedLeased is queries/relay_mark_failed_leased.sql.
func RelayMarkFailedLeased(ids []uuid.UUID, errs []string, backoffsMS []int64, slots []int32, tokens []uuid.UUID, maxAttempts int) Statement {
	return Statement{relayMarkFailedLeasedSQL, pgx.StrictNamedArgs{"ids": ids, "errors": errs, "backoffs_ms": backoffsMS, "slots": slots, "tokens": tokens, "max_attempts": maxAttempts}}
}

// RelayMarkPublished is queries/relay_mark_published.sql.
func RelayMarkPublished(ids []uuid.UUID, streamIDs []string, token uuid.UUID) Statement {
	return Statement{relayMarkPublishedSQL, pgx.StrictNamedArgs{"ids": ids, "stream_ids": streamIDs, "token": token}}
}

// RelayMarkPublishedLeased is queries/relay_mark_published_leased.sql.
func RelayMarkPublishedLeased(ids []uuid.UUID, streamIDs []string, slots []int32, tokens []uuid.UUID) Statement {
	return Statement{relayMarkPublishedLeasedSQL, pgx.StrictNamedArgs{"ids": ids, "stream_ids": streamIDs, "slots": slots, "tokens": tokens}}
}

// RelayNotify is queries/relay_notify.sql.
func RelayNotify(channel string, payload string) Statement {
	return Statement{relayNotifySQL, pgx.StrictNamedArgs{"channel": channel, "payload": payload}}
}

// RelayRead is queries/relay_read.sql.
func RelayRead(batch int, slots int, usableSlots []int32, inFlight []int64) Statement {
	return Statement{relayReadSQL, pgx.StrictNamedArgs{"batch": batch, "slots": slots, "usable_slots": usableSlots, "in_flight": inFlight}}
}

// RelayReap is queries/relay_reap.sql.
func RelayReap(leaseMS int64, batch int, maxAttempts int) Statement {
	return Statement{relayReapSQL, pgx.StrictNamedArgs{"lease_ms": leaseMS, "batch": batch, "max_attempts": maxAttempts}}
}

// RelayRelease is queries/relay_release.sql.
func RelayRelease(ids []uuid.UUID, token uuid.UUID, afterMS int64, reason string) Statement {
	return Statement{relayReleaseSQL, pgx.StrictNamedArgs{"ids": ids, "token": token, "after_ms": afterMS, "reason": reason}}
}

// RelaySleep is queries/relay_sleep.sql.
func RelaySleep() Statement {
	return Statement{relaySleepSQL, nil}
}

// Status is queries/status.sql.
func Status() Statement {
	return Statement{statusSQL, nil}
}

// StatusListeningRelays is queries/status_listening_relays.sql.
func StatusListeningRelays() Statement {
	return Statement{statusListeningRelaysSQL, nil}
}

// StatusRelaySlots is queries/status_relay_slots.sql.
func StatusRelaySlots() Statement {
	return Statement{statusRelaySlotsSQL, nil}
}

// TransferGet is queries/transfer_get.sql.
func TransferGet(id uuid.UUID) Statement {
	return Statement{transferGetSQL, pgx.StrictNamedArgs{"id": id}}
}

// TransferInsert is queries/transfer_insert.sql.
func TransferInsert(id uuid.UUID, fromAccount string, toAccount string, amountCents int64, currency string) Statement {
	return Statement{transferInsertSQL, pgx.StrictNamedArgs{"id": id, "from_account": fromAccount, "to_account": toAccount, "amount_cents": amountCents, "currency": currency}}
}
