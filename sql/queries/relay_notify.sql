-- Wake the relays listening on @channel (relay.Config.Channel), with a
-- payload saying why (relay/partitions.go: another relay is busy, or gave
-- partition slots back; empty: a relay stopped). Inside a transaction the
-- notification goes out at its commit, after the statements before it.
SELECT pg_notify(@channel, @payload)
