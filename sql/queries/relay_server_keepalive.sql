-- TCP keepalives of this session's server side (the relay's LISTEN
-- connection, migration 0012): a relay whose machine or link died is given
-- up after about @idle_s + @interval_s × @count seconds of silence, or once data sent to it
-- stayed unacknowledged @user_timeout_ms milliseconds; its backend then exits and
-- releases the relay's lock, and the other relays take its work over.
-- Ignored on a Unix socket.
SELECT set_config('tcp_keepalives_idle', @idle_s::int::text, false),
       set_config('tcp_keepalives_interval', @interval_s::int::text, false),
       set_config('tcp_keepalives_count', @count::int::text, false),
       set_config('tcp_user_timeout', @user_timeout_ms::int::text, false)
