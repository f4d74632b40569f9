-- A relay (@relay) stopping: its membership ends at once, so the others' shares
-- grow at their next renewal.
DELETE FROM outbox_relay_members WHERE owner = @relay
