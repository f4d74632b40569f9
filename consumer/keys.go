package consumer

import "github.com/tedbank/outbox/partition"

// Keys names the Redis keys a consumer group keeps under a prefix. With
// several partitions, each partition's keys live under its own prefix
// (Partition), in the hash slot of the partition's stream; the group's
// members and the consumers' names live under the prefix itself.
type Keys struct {
	Prefix string
	// Partitions is how many partitions the keys are split into (0 or 1:
	// one, under Prefix itself).
	Partitions int
}

// Partition returns the keys of partition p: under Prefix{tag}: when there
// are several (package partition), under Prefix when there is one.
func (k Keys) Partition(p int) Keys {
	return Keys{Prefix: partition.Prefix(k.Prefix, p, max(k.Partitions, 1)), Partitions: 1}
}

// Each returns the keys of every partition, by partition number.
func (k Keys) Each() []Keys {
	ks := make([]Keys, max(k.Partitions, 1))
	for p := range ks {
		ks[p] = k.Partition(p)
	}
	return ks
}

// Stats holds a partition's lifetime counters (the consumer adds
// dead_lettered; handlers may add theirs).
func (k Keys) Stats() string { return k.Prefix + "stats" }

// DeadLetters is a partition's dead-letter stream.
func (k Keys) DeadLetters() string { return k.Prefix + "dlq" }

// Lease is the lease of this partition in a group: its value is
// "<epoch>|<consumer>|<process token>", the fencing token (ownership.go).
func (k Keys) Lease(group string) string { return k.Prefix + "lease:" + group }

// LeaseEpoch counts the acquisitions of the partition's lease in a group.
func (k Keys) LeaseEpoch(group string) string { return k.Prefix + "lease-epoch:" + group }

// Members is the group's live consumers, scored by when their membership
// ends.
func (k Keys) Members(group string) string { return k.Prefix + "members:" + group }

// Consumer is the lease of a running consumer's name in a group.
func (k Keys) Consumer(group, name string) string { return k.Prefix + "consumer:" + group + ":" + name }
