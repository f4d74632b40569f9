-- The retention cutoff on the database clock (the clock published_at was
-- written with): now minus @older_than_us microseconds.
SELECT now() - @older_than_us::bigint * interval '1 microsecond'
