-- What a relay looks at several times a second, on its LISTEN connection
-- (migration 0012): whether a relay died (its membership's backend holds no
-- lock any more), and whether writers are silent because of a relay that is
-- gone (the idle flag says "busy" and the relay that said it last is not
-- alive). Both are read from memory: no table but the members' is touched.
SELECT EXISTS (SELECT 1
                 FROM outbox_relay_members m
                WHERE m.pid IS NOT NULL
                  AND m.pid NOT IN (SELECT pid FROM outbox_live_relays)) AS dead,
       (SELECT last_value FROM outbox_relay_idle) = 0
       AND (SELECT last_value FROM outbox_relay_busy_pid) NOT IN (SELECT pid FROM outbox_live_relays) AS silenced
