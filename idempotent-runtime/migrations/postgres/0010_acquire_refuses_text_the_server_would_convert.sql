-- The store's insert of a fresh record refuses a session whose
-- client_encoding would change the tenant and key it names.
--
-- sqlx sends UTF-8 whatever the session's client_encoding says, and the
-- server converts every text parameter from that encoding: left at LATIN1 on
-- a connection of a pool the store shares, `café` arrives as `cafÃ©`, and the
-- record would be written under a key no clean connection looks for (a retry
-- there would run the body again; an ASCII tenant and key read the same in
-- every encoding, and are not refused). The check was in the store's statement,
-- beside the primary-key read; there it cost every replay a little, though
-- only an absent record needs it. Here it runs only when the statement
-- inserts. It raises SQLSTATE IE001, which the store answers with
-- Error::Store (nothing written).
--
-- It also refuses a connection left inside a transaction other code began
-- and wrote in (SQLSTATE IE002): the record would roll back with it.
--
-- This function is on the path of every fresh key, so it is not pinned to its
-- schema with a setting of its own, as migration 0009 pinned it (a setting is
-- set and restored at every call: about 2.6 us in the server, some 4% of a
-- fresh key's throughput with 16 callers): it names the records table with
-- the schema it is in, written into its text when it is created here. It
-- calls built-in functions alone, which are never looked up in pg_temp.

DO $$
DECLARE
    v_name NAME;
BEGIN
    -- The schema the records table is in, found as 0009 finds it.
    SELECT n.nspname INTO v_name
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = to_regclass('idempotency_records')
       AND n.oid IS DISTINCT FROM pg_my_temp_schema();
    IF v_name IS NULL THEN
        RAISE EXCEPTION 'no table idempotency_records on the search_path (or a TEMP table hides it): check the search_path of the pool''s connections';
    END IF;
    -- CREATE OR REPLACE without SET: the setting 0009 gave it goes.
    EXECUTE format($create$
CREATE OR REPLACE FUNCTION %1$I.idempotency_acquire_absent(
    p_tenant TEXT, p_scope TEXT, p_key TEXT, p_fingerprint TEXT, p_token TEXT,
    p_lease_ms BIGINT, p_ttl_ms BIGINT, p_lock_wait_ms BIGINT, p_now BIGINT)
RETURNS BOOLEAN
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_lock_timeout TEXT;
BEGIN
    -- A transaction other code began on this connection, wrote in and left
    -- open (a plain BEGIN and an early return, on a pool the store shares):
    -- the store's statement is its own transaction and has written nothing
    -- yet, so a transaction id already assigned is that code's, and the
    -- record would roll back with its transaction. Refused (IE002).
    IF txid_current_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'IE002',
            MESSAGE = 'the connection is inside a transaction other code began and left open';
    END IF;
    -- As the store's reads_text_as_sent and names_the_record_as_sent: a
    -- SQL_ASCII client has nothing converted, which is what a clean
    -- connection gets in a UTF8 database alone; ASCII reads the same in
    -- every encoding.
    IF NOT (current_setting('client_encoding') = 'UTF8'
            OR current_setting('server_encoding') = 'SQL_ASCII'
            OR (current_setting('client_encoding') = 'SQL_ASCII'
                AND current_setting('server_encoding') = 'UTF8'))
       AND (p_tenant || p_key) ~ '[^\x01-\x7f]' THEN
        RAISE EXCEPTION USING ERRCODE = 'IE001',
            MESSAGE = 'client_encoding ' || current_setting('client_encoding')
                      || ' would change the tenant and key the store names';
    END IF;
    -- An assignment, not PERFORM: plpgsql evaluates a simple expression
    -- without a query of its own.
    v_lock_timeout := set_config('lock_timeout', greatest(p_lock_wait_ms, 1)::TEXT || 'ms', TRUE);
    INSERT INTO %1$I.idempotency_records
        (tenant, scope, key, state, fingerprint, owner_token, lease_expires_at,
         expires_at, created_at, updated_at, attempt, attempt_started_at)
    VALUES (p_tenant, p_scope, p_key, 'in_progress', p_fingerprint, p_token,
            p_now + p_lease_ms, p_now + p_ttl_ms, p_now, p_now, 1, p_now)
    ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$fn$
$create$, v_name);
END
$$;
