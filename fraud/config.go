package fraud

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/partition"
)

// Defaults for the zero fields of Config.
const (
	DefaultStream           = "outbox.event.transfer"
	DefaultGroup            = "fraud"
	DefaultKeyPrefix        = "fraud:"
	DefaultBatchSize        = consumer.DefaultBatchSize
	DefaultBlock            = consumer.DefaultBlock
	DefaultClaimInterval    = consumer.DefaultClaimInterval
	DefaultClaimMinIdle     = consumer.DefaultClaimMinIdle
	DefaultMaxDeliveries    = consumer.DefaultMaxDeliveries
	DefaultDedupeTTL        = 7 * 24 * time.Hour
	DefaultRetention        = 7 * 24 * time.Hour
	DefaultAmountLimitCents = 5_000_000  // R$ 50.000,00 in one TED
	DefaultWindowLimitCents = 10_000_000 // R$ 100.000,00 per sender per window
	DefaultWindow           = time.Hour
	DefaultPartitionLease   = consumer.DefaultPartitionLease
)

// Config tunes a Consumer: the consumer group's settings (consumer.Config:
// stream, group, this consumer's name, key prefix, batches, claims,
// partitions, the Redis checks, logger, metrics) and anti-fraud's own. The
// zero value of every field means its default; the group's defaults are
// anti-fraud's (DefaultStream, DefaultGroup, DefaultKeyPrefix, the
// consumer's name the hostname, Name "fraud": metrics outbox_fraud_*).
type Config struct {
	consumer.Config
	// DedupeTTL is how long a processed event id is remembered. It must exceed
	// every redelivery window: New rejects one that does not outlive the
	// relays' (RelayRedelivery) and the group's own
	// (consumer.Config.CheckDedupeWindow). Outages longer than it are not
	// covered: a consumer stopped for longer than the TTL with entries read
	// and not acknowledged applies them again.
	DedupeTTL time.Duration
	// MinReplicas: after each batch's effects the consumer waits (Redis
	// WAIT, on the connection that wrote them) until this many replicas
	// have them, ReplicaTimeout at most (default 1s), and acknowledges the
	// entries only then; otherwise they stay pending and are applied again
	// (the dedupe marker makes that harmless where the effect survived). 0,
	// the default, does not wait. On a Redis Cluster client each
	// partition's effects are pipelined on a connection to the master
	// serving its slot, and WAIT runs there.
	MinReplicas    int
	ReplicaTimeout time.Duration
	// Retention is how long verdicts, the per-sender daily totals and the
	// alerts stream are kept: a transfer's verdict and its day's totals
	// expire together, Retention after the end of its settlement day (UTC).
	// It bounds the Redis memory the consumer uses (docs/operations.md).
	Retention time.Duration
	// The velocity rule: a transfer goes to review when its amount exceeds
	// AmountLimitCents, or when the sender's total over Window (this transfer
	// included) exceeds WindowLimitCents.
	AmountLimitCents int64
	WindowLimitCents int64
	Window           time.Duration
	// AuditLen, when positive, keeps an audit stream per partition
	// (Keys.Audit): one entry per effect applied (event_id, transfer_id,
	// from_account and the verdict given then), written by the effect script
	// atomically with the effect, so its order is the order effects were
	// applied; trimmed to about AuditLen entries (XADD MAXLEN ~). It proves
	// per-sender order after the fact (the chaos suite checks it). 0, the
	// default, keeps none.
	AuditLen int
	// Observer, when set, is told of every delivery of a valid event once
	// its effect is applied or skipped (observer.go).
	Observer Observer
}

func (c Config) withDefaults() Config {
	c.Name = cmp.Or(c.Name, "fraud")
	c.Stream = cmp.Or(c.Stream, DefaultStream)
	c.Group = cmp.Or(c.Group, DefaultGroup)
	if c.Consumer == "" {
		host, err := os.Hostname()
		if err != nil || host == "" {
			host = "fraud"
		}
		c.Consumer = host
	}
	c.KeyPrefix = cmp.Or(c.KeyPrefix, DefaultKeyPrefix)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.Block = cmp.Or(c.Block, DefaultBlock)
	c.ClaimInterval = cmp.Or(c.ClaimInterval, DefaultClaimInterval)
	c.ClaimMinIdle = cmp.Or(c.ClaimMinIdle, DefaultClaimMinIdle)
	c.MaxDeliveries = cmp.Or(c.MaxDeliveries, DefaultMaxDeliveries)
	c.DedupeTTL = cmp.Or(c.DedupeTTL, DefaultDedupeTTL)
	c.ReplicaTimeout = cmp.Or(c.ReplicaTimeout, time.Second)
	c.Partitions = cmp.Or(c.Partitions, 1)
	c.PartitionLease = cmp.Or(c.PartitionLease, DefaultPartitionLease)
	c.Retention = cmp.Or(c.Retention, DefaultRetention)
	c.AmountLimitCents = cmp.Or(c.AmountLimitCents, DefaultAmountLimitCents)
	c.WindowLimitCents = cmp.Or(c.WindowLimitCents, DefaultWindowLimitCents)
	c.Window = cmp.Or(c.Window, DefaultWindow)
	c.Logger = cmp.Or(c.Logger, slog.Default())
	return c
}

// ErrConfig is wrapped by every error of Validate, and so of New for a
// Config that cannot work.
var ErrConfig = errors.New("fraud config")

// Validate reports the first setting that cannot work, after defaults; the
// error wraps ErrConfig.
func (c Config) Validate() error {
	if err := c.withDefaults().validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return nil
}

func (c Config) validate() error {
	if err := c.Config.Validate(); err != nil {
		return err
	}
	return c.validateOwn()
}

// validateOwn checks anti-fraud's own settings (New leaves the group's to
// consumer.New, so that each is checked once).
func (c Config) validateOwn() error {
	switch {
	case c.DedupeTTL < c.ClaimMinIdle || c.DedupeTTL < time.Minute:
		return fmt.Errorf("dedupe TTL %s: must be at least a minute and longer than the claim min idle", c.DedupeTTL)
	case c.MinReplicas < 0 || c.ReplicaTimeout < time.Millisecond:
		return fmt.Errorf("min replicas %d / replica timeout %s: must not be negative / at least 1ms", c.MinReplicas, c.ReplicaTimeout)
	case c.Retention < time.Hour:
		return fmt.Errorf("retention %s: must be at least an hour", c.Retention)
	case c.AmountLimitCents < 1 || c.WindowLimitCents < 1:
		return fmt.Errorf("limits must be positive")
	case c.AuditLen < 0:
		return fmt.Errorf("audit length %d: must not be negative", c.AuditLen)
	case c.Window < time.Second:
		return fmt.Errorf("window %s: must be at least 1s", c.Window)
	}
	return nil
}

// Keys names the Redis keys under a prefix. With several partitions, the
// consumer state of each lives under its own prefix (Partition): the
// methods name the keys of one partition, or of the only one.
type Keys struct {
	Prefix string
	// Partitions is how many partitions the state is split into (0 or 1:
	// one, under Prefix itself).
	Partitions int
}

// Partition returns the keys of partition p: under Prefix{tag}: when there
// are several (package partition), under Prefix when there is one.
func (k Keys) Partition(p int) Keys { return Keys(k.engine().Partition(p)) }

// Each returns the keys of every partition, by partition number.
func (k Keys) Each() []Keys {
	var ks []Keys
	for _, e := range k.engine().Each() {
		ks = append(ks, Keys(e))
	}
	return ks
}

// Sender returns the keys of the partition of a sender account: the one
// holding its verdicts and totals.
func (k Keys) Sender(account string) Keys {
	return k.Partition(partition.Of(account, max(k.Partitions, 1)))
}

// Seen is an event's dedupe marker; its value is the verdict.
func (k Keys) Seen(eventID string) string { return k.Prefix + "seen:" + eventID }

// Verdict is a transfer's verdict ("approve" or "review").
func (k Keys) Verdict(transferID string) string { return k.Prefix + "verdict:" + transferID }

// Verdicts is the hash in which consumers before the retention kept every
// verdict, with no expiry. It is no longer written; lookups still read it
// for transfers judged before an upgrade (delete it once they no longer
// matter).
func (k Keys) Verdicts() string { return k.Prefix + "verdicts" }

// BatchGate is the gate of one batch's pipeline of effects (effect.lua):
// the senders whose event failed in it, so that their later events in the
// same pipeline are held. It exists only after a failure, for a minute.
func (k Keys) BatchGate(batch string) string { return k.Prefix + "batch:" + batch }

// Days indexes the settlement days (YYYY-MM-DD) that have totals, by day
// number.
func (k Keys) Days() string { return k.Prefix + "days" }

// DayAccounts is the set of the sender accounts with totals on day.
func (k Keys) DayAccounts(day string) string { return k.Prefix + "day:" + day + ":accounts" }

// DayAccount holds a sender's totals of one day: sent_cents and transfers.
func (k Keys) DayAccount(day, acct string) string {
	return k.Prefix + "day:" + day + ":account:" + acct
}

// Window is the sender's recent transfers, for the velocity rule.
func (k Keys) Window(acct string) string { return k.Prefix + "window:" + acct }

// WindowEntries held the transfers of the sender's window with the running
// sum of their amounts in the window's second format, before its members
// carried them: effect.lua reads it only to convert such a window.
func (k Keys) WindowEntries(acct string) string { return k.Prefix + "window-entries:" + acct }

// Approved held the sender's recent transfers that were still approved,
// in the window's second format, before its members carried that:
// effect.lua reads it only to convert such a window.
func (k Keys) Approved(acct string) string { return k.Prefix + "approved:" + acct }

// Audit is the stream of effects in the order applied (Config.AuditLen).
func (k Keys) Audit() string { return k.Prefix + "audit" }

// Layouts is the hash of the numbers of partitions the group's consumers
// have run with, and when each was last used (layouts.go): under the plain
// prefix, whatever the partitions.
func (k Keys) Layouts() string { return k.Prefix + "layouts" }

// Stats holds the lifetime counters of the report.
func (k Keys) Stats() string { return k.engine().Stats() }

// Alerts is the stream of transfers sent to review.
func (k Keys) Alerts() string { return k.Prefix + "alerts" }

// DeadLetters is the dead-letter stream.
func (k Keys) DeadLetters() string { return k.engine().DeadLetters() }

// Lease is the lease of this partition's keys in a group: its value is
// "<epoch>|<consumer>|<process token>" (ownership.go).
func (k Keys) Lease(group string) string { return k.engine().Lease(group) }

// LeaseEpoch counts the acquisitions of the partition's lease in a group.
func (k Keys) LeaseEpoch(group string) string { return k.engine().LeaseEpoch(group) }

// Members is the group's live consumers, scored by when their membership
// ends.
func (k Keys) Members(group string) string { return k.engine().Members(group) }

// Consumer is the lease of a running consumer's name in a group.
func (k Keys) Consumer(group, name string) string { return k.engine().Consumer(group, name) }

// engine is the part of the keys the consumer package keeps: leases,
// members, names, stats, dead letters.
func (k Keys) engine() consumer.Keys {
	return consumer.Keys{Prefix: k.Prefix, Partitions: k.Partitions}
}

// Day is the settlement day of t (UTC) as the keys name it, and its number.
func Day(t time.Time) (day string, number int64) {
	n := t.UnixMilli() / msPerDay
	return time.UnixMilli(n * msPerDay).UTC().Format(time.DateOnly), n
}

// DayExpiry is when the verdict and day totals of a transfer settled at t
// expire: the end of its UTC day plus retention.
func DayExpiry(t time.Time, retention time.Duration) time.Time {
	n := t.UnixMilli() / msPerDay
	return time.UnixMilli((n+1)*msPerDay + retention.Milliseconds())
}

const msPerDay = 24 * 60 * 60 * 1000
