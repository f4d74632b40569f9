-- The retention cutoff on the database clock (the clock published_at was
-- written with): now minus $1 microseconds.
SELECT now() - $1::bigint * interval '1 microsecond'
