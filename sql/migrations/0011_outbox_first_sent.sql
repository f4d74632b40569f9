-- The redelivery window as a bound: consumers keep their dedupe
-- records for a time (anti-fraud's --dedupe-ttl, the inbox's retention) and
-- refuse one shorter than the relays' redelivery window, so a relay must
-- never publish an event again later than that window after it may first
-- have reached the broker. first_sent_at is that moment: set when a publish
-- may have landed without being marked (a claim that expired, a publish whose
-- reply timed out or whose replicas did not confirm it), never when the
-- broker surely did not take it (a refused connection). NULL: never sent, or
-- sent and marked. The claim and the partition owners' read skip rows whose
-- first_sent_at is older than the window, and the reaper marks them dead
-- with the reason, for an operator to retry knowingly (outbox dead retry).
-- The claim and the read filter on it among the rows they already fetch; the
-- reaper's look-up has a partial index of its own, which holds only the rows
-- sent and not marked (usually none), and which neither a claim nor a
-- partition owner's read changes (claims stay HOT updates, migration 0007).
ALTER TABLE outbox_messages ADD COLUMN first_sent_at timestamptz;
CREATE INDEX outbox_messages_sent_unmarked ON outbox_messages (first_sent_at)
    WHERE unpublished AND first_sent_at IS NOT NULL;
