-- The relays whose LISTEN connection is open on this database: each names
-- it '<application_name>-listen', the application name starting with
-- outbox-relay by default (relay.New).
SELECT count(*)
  FROM pg_stat_activity
 WHERE datname = current_database()
   AND application_name LIKE 'outbox-relay%-listen'
