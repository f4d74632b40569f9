// Package entry is the wire format of the stream entries the relay writes:
// the names of their fields, which consumers read. It imports nothing of this
// project, so a consumer links it without the relay.
//
// Every field is a string: Payload is the event's payload as written to the
// outbox (JSON for transfer events), Headers a JSON object of strings (with a
// W3C traceparent when tracing is on), OccurredAt the outbox row's creation
// time in RFC 3339 with nanoseconds, Seq the row's seq in decimal,
// PartitionKey the event's partition key (the outbox row's partition_key, or
// its aggregate id when it has none): the unit of order, which consumers keep
// across failures (an entry without it is ordered after every earlier one).
package entry

const (
	EventID       = "event_id"
	EventType     = "event_type"
	AggregateType = "aggregate_type"
	AggregateID   = "aggregate_id"
	Payload       = "payload"
	Headers       = "headers"
	OccurredAt    = "occurred_at"
	Seq           = "seq"
	PartitionKey  = "partition_key"
)
