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

// CloudEvents binary content mode (relay.Config.CloudEvents; off by
// default): an entry also carries the event's CloudEvents 1.0 attributes,
// each in a field of its own, the payload being the event's data. The
// fields above stay the contract; these are added to them. On NATS
// JetStream the same attributes are also written as the NATS protocol
// binding's headers (CEHeaderPrefix: "ce-id", "ce-type", ...), which the
// CloudEvents SDKs read.
const (
	CEID          = "ce_id"          // the event id
	CEType        = "ce_type"        // the event type ("transfer.settled")
	CESource      = "ce_source"      // relay.Config.CloudEventsSource, default "/outbox/<aggregate_type>"
	CETime        = "ce_time"        // occurred_at (RFC 3339)
	CESpecVersion = "ce_specversion" // "1.0"
	// CEPartitionKey is the partitioning extension's partitionkey: the
	// event's partition key.
	CEPartitionKey = "ce_partitionkey"
	// ContentType is the data's media type (datacontenttype):
	// "application/json".
	ContentType = "content-type"

	// CEFieldPrefix prefixes the attributes in a stream entry;
	// CEHeaderPrefix in the NATS binding's headers.
	CEFieldPrefix  = "ce_"
	CEHeaderPrefix = "ce-"
)
