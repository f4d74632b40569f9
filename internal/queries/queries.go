// Package queries builds the statements of the queries in sql/queries
// (embedded by package outboxsql): one function per file, with the query's
// named parameters (@name) as typed Go parameters. It is internal: the
// library's packages run these; a team reads the SQL in sql/.
package queries

import (
	"context"
	"fmt"
	"io/fs"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	outboxsql "github.com/tedbank/outbox/sql"
)

// A Statement is one query of queries/ with its arguments in order, for
// Exec, Query, QueryRow or a pgx.Batch: pool.Exec(ctx, s.SQL, s.Args...).
// The functions below build one per query, with the query's named
// parameters (@name) as typed Go parameters.
type Statement struct {
	SQL  string
	Args []any
}

// The queries, read and rewritten to positional parameters when the package
// is initialized (prepare): a missing file, or a parameter the SQL and its
// function do not agree on, stops the program at start, before any work.
// Each file's comment says what the query does and what its parameters are.
var (
	adminAuditInsert         = prepare("admin_audit_insert", "actor", "origin", "action", "target", "reason", "outcome")
	adminAuditList           = prepare("admin_audit_list", "max_rows")
	adminCleanup             = prepare("admin_cleanup", "before", "after_seq", "batch")
	adminCleanupCutoff       = prepare("admin_cleanup_cutoff", "older_than_us")
	adminCleanupDone         = prepare("admin_cleanup_done", "id", "deleted")
	adminCleanupRecord       = prepare("admin_cleanup_record", "cutoff")
	adminDeadList            = prepare("admin_dead_list", "aggregate_type", "max_rows")
	adminDeadRetry           = prepare("admin_dead_retry", "ids")
	adminDeadRetryAll        = prepare("admin_dead_retry_all", "after_seq", "batch")
	adminRepublish           = prepare("admin_republish", "ids", "by", "reason")
	inboxCleanup             = prepare("inbox_cleanup", "consumer_group", "retention_us", "batch")
	inboxFence               = prepare("inbox_fence", "consumer_group", "partition", "epoch")
	inboxInsert              = prepare("inbox_insert", "consumer_group", "event_ids")
	ledgerBalances           = prepare("ledger_balances")
	ledgerPost               = prepare("ledger_post", "transfer_ids", "event_ids", "from_accounts", "to_accounts", "amount_cents", "currencies", "settled_ats")
	ledgerPostings           = prepare("ledger_postings", "transfer_ids")
	metricsOutbox            = prepare("metrics_outbox")
	outboxInsert             = prepare("outbox_insert", "ids", "aggregate_types", "aggregate_ids", "event_types", "payloads", "headers", "partition_keys")
	outboxLockPartitions     = prepare("outbox_lock_partitions", "lock_slots")
	reconcileCleanupHorizon  = prepare("reconcile_cleanup_horizon")
	reconcileEvents          = prepare("reconcile_events", "since")
	reconcileSenderTransfers = prepare("reconcile_sender_transfers", "senders")
	relayBusy                = prepare("relay_busy", "pid")
	relayClaim               = prepare("relay_claim", "batch", "token", "relay", "window_ms", "pid", "max_bytes")
	relayBury                = prepare("relay_bury")
	relayExpire              = prepare("relay_expire", "window_ms", "batch")
	relayLeaseAcquire        = prepare("relay_lease_acquire", "relay", "lease_ms", "count", "pid")
	relayLeaseLeave          = prepare("relay_lease_leave", "relay")
	relayLeaseRelease        = prepare("relay_lease_release", "relay", "slots")
	relayLeaseRenew          = prepare("relay_lease_renew", "relay", "lease_ms", "rotate", "pid")
	relayLeaseShare          = prepare("relay_lease_share")
	relayMarkFailed          = prepare("relay_mark_failed", "ids", "errors", "backoffs_ms", "token", "max_attempts")
	relayMarkFailedLeased    = prepare("relay_mark_failed_leased", "ids", "errors", "backoffs_ms", "slots", "tokens", "max_attempts")
	relayMarkPublished       = prepare("relay_mark_published", "ids", "stream_ids", "token")
	relayMarkPublishedLeased = prepare("relay_mark_published_leased", "ids", "stream_ids", "slots", "tokens")
	relayNotify              = prepare("relay_notify", "channel", "payload")
	relayOwnershipAuto       = prepare("relay_ownership_auto", "lease_ms")
	relayOwnershipHold       = prepare("relay_ownership_hold", "mode")
	relayOwnershipOther      = prepare("relay_ownership_other", "mode")
	relayRead                = prepare("relay_read", "batch", "slots", "usable_slots", "in_flight", "window_ms", "max_bytes")
	relayReap                = prepare("relay_reap", "lease_ms", "batch", "max_attempts", "self_pid")
	relayRegister            = prepare("relay_register", "relay", "lease_ms")
	relayRestamp             = prepare("relay_restamp", "relay", "past_pids", "tokens")
	relayRelease             = prepare("relay_release", "ids", "token", "after_ms", "reason")
	relayMarkSent            = prepare("relay_mark_sent", "ids")
	relayServerKeepalive     = prepare("relay_server_keepalive", "idle_s", "interval_s", "count", "user_timeout_ms")
	relaySleep               = prepare("relay_sleep")
	relayWatch               = prepare("relay_watch", "stall_ms")
	relayStalled             = prepare("relay_stalled", "pids", "stall_ms")
	status                   = prepare("status", "aggregate_type")
	statusListeningRelays    = prepare("status_listening_relays")
	statusLight              = prepare("status_light", "aggregate_type")
	statusRelayPartitions    = prepare("status_relay_partitions", "max_rows")
	statusRelays             = prepare("status_relays")
	statusRetrying           = prepare("status_retrying", "aggregate_type", "max_rows")
	settlePlain              = prepare("settle_plain", "id", "from_account", "to_account", "amount_cents", "event_id")
	transferGet              = prepare("transfer_get", "id")
	transferInsert           = prepare("transfer_insert", "id", "from_account", "to_account", "amount_cents", "currency")
)

// AdminAuditInsert is queries/admin_audit_insert.sql.
func AdminAuditInsert(actor, origin, action, target, reason, outcome string) Statement {
	return adminAuditInsert.with(actor, origin, action, target, reason, outcome)
}

// AdminAuditList is queries/admin_audit_list.sql.
func AdminAuditList(maxRows int64) Statement {
	return adminAuditList.with(maxRows)
}

// AdminCleanup is queries/admin_cleanup.sql.
func AdminCleanup(before time.Time, afterSeq int64, batch int64) Statement {
	return adminCleanup.with(before, afterSeq, batch)
}

// AdminCleanupCutoff is queries/admin_cleanup_cutoff.sql.
func AdminCleanupCutoff(olderThanUS int64) Statement {
	return adminCleanupCutoff.with(olderThanUS)
}

// AdminCleanupDone is queries/admin_cleanup_done.sql.
func AdminCleanupDone(id int64, deleted int64) Statement {
	return adminCleanupDone.with(id, deleted)
}

// AdminCleanupRecord is queries/admin_cleanup_record.sql.
func AdminCleanupRecord(cutoff time.Time) Statement {
	return adminCleanupRecord.with(cutoff)
}

// AdminDeadList is queries/admin_dead_list.sql.
func AdminDeadList(aggregateType string, maxRows int64) Statement {
	return adminDeadList.with(aggregateType, maxRows)
}

// AdminRepublish is queries/admin_republish.sql.
func AdminRepublish(ids []uuid.UUID, by, reason string) Statement {
	return adminRepublish.with(ids, by, reason)
}

// AdminDeadRetry is queries/admin_dead_retry.sql.
func AdminDeadRetry(ids []uuid.UUID) Statement {
	return adminDeadRetry.with(ids)
}

// AdminDeadRetryAll is queries/admin_dead_retry_all.sql.
func AdminDeadRetryAll(afterSeq int64, batch int64) Statement {
	return adminDeadRetryAll.with(afterSeq, batch)
}

// InboxCleanup is queries/inbox_cleanup.sql.
func InboxCleanup(consumerGroup string, retention time.Duration, batch int64) Statement {
	return inboxCleanup.with(consumerGroup, retention.Microseconds(), batch)
}

// InboxFence is queries/inbox_fence.sql.
func InboxFence(consumerGroup string, partition int, epoch int64) Statement {
	return inboxFence.with(consumerGroup, partition, epoch)
}

// InboxInsert is queries/inbox_insert.sql.
func InboxInsert(consumerGroup string, eventIDs []uuid.UUID) Statement {
	return inboxInsert.with(consumerGroup, eventIDs)
}

// LedgerBalances is queries/ledger_balances.sql.
func LedgerBalances() Statement {
	return ledgerBalances.with()
}

// LedgerPost is queries/ledger_post.sql.
func LedgerPost(transferIDs []uuid.UUID, eventIDs []uuid.UUID, fromAccounts []string, toAccounts []string, amountCents []int64, currencies []string, settledAts []time.Time) Statement {
	return ledgerPost.with(transferIDs, eventIDs, fromAccounts, toAccounts, amountCents, currencies, settledAts)
}

// LedgerPostings is queries/ledger_postings.sql.
func LedgerPostings(transferIDs []uuid.UUID) Statement {
	return ledgerPostings.with(transferIDs)
}

// MetricsOutbox is queries/metrics_outbox.sql.
func MetricsOutbox() Statement {
	return metricsOutbox.with()
}

// OutboxInsert is queries/outbox_insert.sql.
func OutboxInsert(ids []uuid.UUID, aggregateTypes []string, aggregateIDs []string, eventTypes []string, payloads []string, headers []string, partitionKeys []string) Statement {
	return outboxInsert.with(ids, aggregateTypes, aggregateIDs, eventTypes, payloads, headers, partitionKeys)
}

// OutboxLockPartitions is queries/outbox_lock_partitions.sql.
func OutboxLockPartitions(lockSlots []int32) Statement {
	return outboxLockPartitions.with(lockSlots)
}

// ReconcileCleanupHorizon is queries/reconcile_cleanup_horizon.sql.
func ReconcileCleanupHorizon() Statement {
	return reconcileCleanupHorizon.with()
}

// ReconcileEvents is queries/reconcile_events.sql.
func ReconcileEvents(since time.Time) Statement {
	return reconcileEvents.with(since)
}

// ReconcileSenderTransfers is queries/reconcile_sender_transfers.sql.
func ReconcileSenderTransfers(senders []string) Statement {
	return reconcileSenderTransfers.with(senders)
}

// RelayOwnershipHold is queries/relay_ownership_hold.sql.
func RelayOwnershipHold(mode int) Statement {
	return relayOwnershipHold.with(mode)
}

// RelayOwnershipOther is queries/relay_ownership_other.sql.
func RelayOwnershipOther(mode int) Statement {
	return relayOwnershipOther.with(mode)
}

// RelayOwnershipAuto is queries/relay_ownership_auto.sql.
func RelayOwnershipAuto(leaseMS int64) Statement {
	return relayOwnershipAuto.with(leaseMS)
}

// RelayBusy is queries/relay_busy.sql.
func RelayBusy(pid uint32) Statement {
	return relayBusy.with(int32(pid))
}

// RelayBury is queries/relay_bury.sql.
func RelayBury() Statement {
	return relayBury.with()
}

// RelayRegister is queries/relay_register.sql.
func RelayRegister(relay string, leaseMS int64) Statement {
	return relayRegister.with(relay, leaseMS)
}

// RelayServerKeepalive is queries/relay_server_keepalive.sql.
func RelayServerKeepalive(idleS, intervalS, count, userTimeoutMS int) Statement {
	return relayServerKeepalive.with(idleS, intervalS, count, userTimeoutMS)
}

// RelayRestamp is queries/relay_restamp.sql.
func RelayRestamp(relay string, pastPIDs []int32, tokens []uuid.UUID) Statement {
	return relayRestamp.with(relay, pastPIDs, tokens)
}

// RelayWatch is queries/relay_watch.sql.
func RelayWatch(stallMS int64) Statement {
	return relayWatch.with(stallMS)
}

// RelayStalled is queries/relay_stalled.sql.
func RelayStalled(pids []int32, stallMS int64) Statement {
	return relayStalled.with(pids, stallMS)
}

// RelayClaim is queries/relay_claim.sql.
func RelayClaim(batch int, token uuid.UUID, relay string, windowMS int64, pid uint32, maxBytes int64) Statement {
	return relayClaim.with(batch, token, relay, windowMS, int32(pid), maxBytes)
}

// RelayExpire is queries/relay_expire.sql.
func RelayExpire(windowMS int64, batch int) Statement {
	return relayExpire.with(windowMS, batch)
}

// RelayMarkSent is queries/relay_mark_sent.sql.
func RelayMarkSent(ids []uuid.UUID) Statement {
	return relayMarkSent.with(ids)
}

// RelayLeaseAcquire is queries/relay_lease_acquire.sql.
func RelayLeaseAcquire(relay string, leaseMS int64, n int, pid uint32) Statement {
	return relayLeaseAcquire.with(relay, leaseMS, n, int32(pid))
}

// RelayLeaseLeave is queries/relay_lease_leave.sql.
func RelayLeaseLeave(relay string) Statement {
	return relayLeaseLeave.with(relay)
}

// RelayLeaseRelease is queries/relay_lease_release.sql.
func RelayLeaseRelease(relay string, slots []int) Statement {
	return relayLeaseRelease.with(relay, slots)
}

// RelayLeaseRenew is queries/relay_lease_renew.sql.
func RelayLeaseRenew(relay string, leaseMS int64, rotate bool, pid uint32) Statement {
	return relayLeaseRenew.with(relay, leaseMS, rotate, int32(pid))
}

// RelayLeaseShare is queries/relay_lease_share.sql.
func RelayLeaseShare() Statement {
	return relayLeaseShare.with()
}

// RelayMarkFailed is queries/relay_mark_failed.sql.
func RelayMarkFailed(ids []uuid.UUID, errs []string, backoffsMS []int64, token uuid.UUID, maxAttempts int) Statement {
	return relayMarkFailed.with(ids, errs, backoffsMS, token, maxAttempts)
}

// RelayMarkFailedLeased is queries/relay_mark_failed_leased.sql.
func RelayMarkFailedLeased(ids []uuid.UUID, errs []string, backoffsMS []int64, slots []int32, tokens []uuid.UUID, maxAttempts int) Statement {
	return relayMarkFailedLeased.with(ids, errs, backoffsMS, slots, tokens, maxAttempts)
}

// RelayMarkPublished is queries/relay_mark_published.sql.
func RelayMarkPublished(ids []uuid.UUID, streamIDs []string, token uuid.UUID) Statement {
	return relayMarkPublished.with(ids, streamIDs, token)
}

// RelayMarkPublishedLeased is queries/relay_mark_published_leased.sql.
func RelayMarkPublishedLeased(ids []uuid.UUID, streamIDs []string, slots []int32, tokens []uuid.UUID) Statement {
	return relayMarkPublishedLeased.with(ids, streamIDs, slots, tokens)
}

// RelayNotify is queries/relay_notify.sql.
func RelayNotify(channel string, payload string) Statement {
	return relayNotify.with(channel, payload)
}

// RelayRead is queries/relay_read.sql.
func RelayRead(batch int, slots int, usableSlots []int32, inFlight []int64, windowMS int64, maxBytes int64) Statement {
	return relayRead.with(batch, slots, usableSlots, inFlight, windowMS, maxBytes)
}

// RelayReap is queries/relay_reap.sql.
func RelayReap(leaseMS int64, batch int, maxAttempts int, selfPID uint32) Statement {
	return relayReap.with(leaseMS, batch, maxAttempts, int32(selfPID))
}

// RelayRelease is queries/relay_release.sql.
func RelayRelease(ids []uuid.UUID, token uuid.UUID, afterMS int64, reason string) Statement {
	return relayRelease.with(ids, token, afterMS, reason)
}

// RelaySleep is queries/relay_sleep.sql.
func RelaySleep() Statement {
	return relaySleep.with()
}

// Status is queries/status.sql.
func Status(aggregateType string) Statement {
	return status.with(aggregateType)
}

// StatusListeningRelays is queries/status_listening_relays.sql.
func StatusListeningRelays() Statement {
	return statusListeningRelays.with()
}

// StatusLight is queries/status_light.sql.
func StatusLight(aggregateType string) Statement {
	return statusLight.with(aggregateType)
}

// StatusRelayPartitions is queries/status_relay_partitions.sql.
func StatusRelayPartitions(maxRows int64) Statement {
	return statusRelayPartitions.with(maxRows)
}

// StatusRelays is queries/status_relays.sql.
func StatusRelays() Statement {
	return statusRelays.with()
}

// StatusRetrying is queries/status_retrying.sql.
func StatusRetrying(aggregateType string, maxRows int64) Statement {
	return statusRetrying.with(aggregateType, maxRows)
}

// TransferGet is queries/transfer_get.sql.
func TransferGet(id uuid.UUID) Statement {
	return transferGet.with(id)
}

// TransferInsert is queries/transfer_insert.sql.
func TransferInsert(id uuid.UUID, fromAccount string, toAccount string, amountCents int64, currency string) Statement {
	return transferInsert.with(id, fromAccount, toAccount, amountCents, currency)
}

// loaded are the queries load read, by name.
var loaded = map[string]string{}

// load returns the text of queries/<name>.sql, and panics if the file is
// missing (at package initialization: queries.go).
func load(name string) string {
	b, err := fs.ReadFile(outboxsql.Queries, "queries/"+name+".sql")
	if err != nil {
		panic(fmt.Sprintf("queries: no query %q: %v", name, err))
	}
	loaded[name] = string(b)
	return string(b)
}

// Query returns the text of queries/<name>.sql, or "" if queries.go does
// not load it (a test checks that it loads every file). Code uses the
// variables of queries.go; Query is for tests that go through every query.
func Query(name string) string { return loaded[name] }

// QueryFS exposes the query files, for tests that check every one of them.
func QueryFS() fs.FS { return outboxsql.Queries }

// Positional returns query with its named parameters (@name) numbered ($1,
// $2... in order of first appearance), as the Statements send it: for tests
// that prepare or EXPLAIN a query, or trace it by its text.
func Positional(query string) string {
	sql, _, err := pgx.NamedArgs{}.RewriteQuery(context.Background(), nil, query, nil)
	if err != nil {
		panic(fmt.Sprintf("queries: rewrite named parameters: %v", err))
	}
	return sql
}

// query is one query file rewritten to positional parameters ($1, $2...,
// in order of first appearance of each @name), with, for each of them, the
// index of the function parameter that fills it.
type query struct {
	sql   string
	order []int
}

// prepare loads queries/<name>.sql and rewrites its named parameters, once.
// params are the names of the function's parameters, in its order; it
// panics unless the SQL uses exactly those names.
func prepare(name string, params ...string) query {
	index := make(pgx.StrictNamedArgs, len(params))
	for i, p := range params {
		index[p] = i
	}
	sql, order, err := index.RewriteQuery(context.Background(), nil, load(name), nil)
	if err != nil {
		panic(fmt.Sprintf("queries: queries/%s.sql: %v", name, err))
	}
	q := query{sql: sql, order: make([]int, len(order))}
	for i, o := range order {
		q.order[i] = o.(int)
	}
	return q
}

// with is q with values (in the order of prepare's params) as its arguments.
func (q query) with(values ...any) Statement {
	args := make([]any, len(q.order))
	for i, j := range q.order {
		args[i] = values[j]
	}
	return Statement{SQL: q.sql, Args: args}
}

// SettlePlain is queries/settle_plain.sql.
func SettlePlain(id uuid.UUID, from, to string, amountCents int64, eventID uuid.UUID) Statement {
	return settlePlain.with(id, from, to, amountCents, eventID)
}
