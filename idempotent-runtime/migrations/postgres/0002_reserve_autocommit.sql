-- Store-mode reservation: `PgStore::reserve` sends one statement on a pooled
-- connection, which is its own (implicit) transaction. The decisions are those
-- of idempotency_reserve (0001), without the subtransaction (plpgsql
-- BEGIN ... EXCEPTION) that keeps a caller's transaction usable after a lock
-- timeout, and without restoring lock_timeout: set_config(..., TRUE) ends with
-- the statement's own transaction. A subtransaction costs an extra XID and
-- WAL on every reservation, and there is no caller transaction to protect here.
--
-- Waits at most p_lock_wait_ms for a row locked by another transaction (a
-- transactional-mode owner's uncommitted reservation); when that runs out the
-- statement fails with lock_not_available (SQLSTATE 55P03), which the store
-- answers as in_progress. Transactional mode keeps using idempotency_reserve.
CREATE OR REPLACE FUNCTION idempotency_reserve_autocommit(
    p_tenant TEXT, p_scope TEXT, p_key TEXT, p_fingerprint TEXT, p_token TEXT,
    p_lease_ms BIGINT, p_ttl_ms BIGINT, p_lock_wait_ms BIGINT,
    OUT outcome TEXT, OUT took_over BOOLEAN, OUT is_error BOOLEAN, OUT result BYTEA,
    OUT lease_remaining_ms BIGINT)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now BIGINT;
    r idempotency_records%ROWTYPE;
    v_decision TEXT;
    v_locked BOOLEAN;
    v_attempt INT := 0;
BEGIN
    took_over := FALSE;
    PERFORM set_config('lock_timeout', greatest(p_lock_wait_ms, 1)::TEXT || 'ms', TRUE);
    <<attempts>>
    LOOP
        v_attempt := v_attempt + 1;
        IF v_attempt > 50 THEN
            RAISE EXCEPTION 'idempotency_reserve_autocommit: the record kept changing under this reservation; retry';
        END IF;
        v_now := idempotency_now_ms();
        INSERT INTO idempotency_records AS t
            (tenant, scope, key, state, fingerprint, owner_token, lease_expires_at,
             expires_at, created_at, updated_at)
        VALUES (p_tenant, p_scope, p_key, 'in_progress', p_fingerprint, p_token,
                v_now + p_lease_ms, v_now + p_ttl_ms, v_now, v_now)
        ON CONFLICT (tenant, scope, key) DO NOTHING;
        IF FOUND THEN
            outcome := 'acquired';
            EXIT attempts;
        END IF;
        -- A plain read first: replays, refusals and mismatches take no lock.
        v_locked := FALSE;
        LOOP
            IF v_locked THEN
                SELECT * INTO r FROM idempotency_records
                 WHERE tenant = p_tenant AND scope = p_scope AND key = p_key FOR UPDATE;
            ELSE
                SELECT * INTO r FROM idempotency_records
                 WHERE tenant = p_tenant AND scope = p_scope AND key = p_key;
            END IF;
            IF NOT FOUND THEN
                CONTINUE attempts;   -- deleted meanwhile: insert again
            END IF;
            v_now := idempotency_now_ms();
            IF r.expires_at <= v_now
               AND (r.state = 'complete' OR r.lease_expires_at <= v_now) THEN
                v_decision := 'replace';
            ELSIF r.fingerprint IS NOT NULL AND p_fingerprint IS NOT NULL
                  AND r.fingerprint <> p_fingerprint THEN
                v_decision := 'mismatch';
            ELSIF r.state = 'complete' THEN
                v_decision := 'completed';
            ELSIF r.lease_expires_at > v_now THEN
                v_decision := 'in_progress';
            ELSE
                v_decision := 'takeover';
            END IF;
            EXIT WHEN v_locked OR v_decision NOT IN ('replace', 'takeover');
            v_locked := TRUE;        -- a write is due: decide again under the row lock
        END LOOP;

        CASE v_decision
        WHEN 'replace' THEN
            UPDATE idempotency_records SET
                state = 'in_progress', fingerprint = p_fingerprint, owner_token = p_token,
                is_error = FALSE, result = NULL, lease_expires_at = v_now + p_lease_ms,
                expires_at = v_now + p_ttl_ms, created_at = v_now, updated_at = v_now
             WHERE tenant = p_tenant AND scope = p_scope AND key = p_key;
            outcome := 'acquired';
        WHEN 'takeover' THEN
            UPDATE idempotency_records SET
                fingerprint = p_fingerprint, owner_token = p_token,
                lease_expires_at = v_now + p_lease_ms, expires_at = v_now + p_ttl_ms,
                updated_at = v_now
             WHERE tenant = p_tenant AND scope = p_scope AND key = p_key;
            outcome := 'acquired';
            took_over := TRUE;
        WHEN 'completed' THEN
            outcome := 'completed';
            is_error := r.is_error;
            result := r.result;
        WHEN 'in_progress' THEN
            outcome := 'in_progress';
            lease_remaining_ms := r.lease_expires_at - v_now;
        ELSE
            outcome := 'mismatch';
        END CASE;
        EXIT attempts;
    END LOOP;
END
$$;
