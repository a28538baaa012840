-- syncguard_channel: the channel a key's wake-ups are sent on, a hash of its storage
-- key, so that any key fits PostgreSQL's 63-byte identifiers.
-- django_syncguard.backends.database.wakeups computes the same name (channel_name) to
-- LISTEN on it; tests/test_database_sql_files.py checks that both agree.
CREATE OR REPLACE FUNCTION syncguard_channel(p_key text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT 'syncguard_' || left(encode(sha256(convert_to(p_key, 'UTF8')), 'hex'), 40)
$$;
