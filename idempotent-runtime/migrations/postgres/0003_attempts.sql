-- Uncertain outcomes (DESIGN.md rule 20): every record keeps its attempt
-- number, so a takeover of an expired lease knows it is the 2nd, 3rd, ...
-- attempt and when the previous one started, across restarts and processes.
--
-- * attempt            1 for a fresh record (and for one that replaced an
--                      expired record); +1 on every takeover of an expired lease.
-- * attempt_started_at when the current attempt took the record (ms, database
--                      clock). NULL on rows written before this migration:
--                      readers fall back to created_at.
-- * recovered          the recorded result came from a `recover` hook, not
--                      from the body (counted by audits).
--
-- Both reservation functions are replaced (same arguments, two more OUT
-- columns: attempt_number, previous_attempt_started_at). Callers that select
-- the earlier five columns by name keep working, and keep the attempt count
-- right, so processes running an older idempotent-runtime may share the table.
ALTER TABLE idempotency_records
    ADD COLUMN IF NOT EXISTS attempt INT NOT NULL DEFAULT 1,
    ADD COLUMN IF NOT EXISTS attempt_started_at BIGINT,
    ADD COLUMN IF NOT EXISTS recovered BOOLEAN NOT NULL DEFAULT FALSE;

-- The OUT columns change, which CREATE OR REPLACE cannot do: drop and create
-- in this migration's transaction, so no session ever finds neither.
DROP FUNCTION IF EXISTS idempotency_reserve(TEXT, TEXT, TEXT, TEXT, TEXT, BIGINT, BIGINT, BIGINT);
DROP FUNCTION IF EXISTS idempotency_reserve_autocommit(TEXT, TEXT, TEXT, TEXT, TEXT, BIGINT, BIGINT, BIGINT);

-- Transactional mode: the decisions of 0001, keeping the attempt number.
CREATE FUNCTION idempotency_reserve(
    p_tenant TEXT, p_scope TEXT, p_key TEXT, p_fingerprint TEXT, p_token TEXT,
    p_lease_ms BIGINT, p_ttl_ms BIGINT, p_lock_wait_ms BIGINT,
    OUT outcome TEXT, OUT took_over BOOLEAN, OUT is_error BOOLEAN, OUT result BYTEA,
    OUT lease_remaining_ms BIGINT, OUT attempt_number INT,
    OUT previous_attempt_started_at BIGINT)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now BIGINT;
    r idempotency_records%ROWTYPE;
    v_decision TEXT;
    v_locked BOOLEAN;
    v_attempt INT := 0;
    v_old_lock_timeout TEXT := current_setting('lock_timeout');
BEGIN
    took_over := FALSE;
    BEGIN
        PERFORM set_config('lock_timeout', greatest(p_lock_wait_ms, 1)::TEXT || 'ms', TRUE);
        <<attempts>>
        LOOP
            v_attempt := v_attempt + 1;
            IF v_attempt > 50 THEN
                RAISE EXCEPTION 'idempotency_reserve: the record kept changing under this reservation; retry';
            END IF;
            v_now := idempotency_now_ms();
            INSERT INTO idempotency_records AS t
                (tenant, scope, key, state, fingerprint, owner_token, lease_expires_at,
                 expires_at, created_at, updated_at, attempt, attempt_started_at, recovered)
            VALUES (p_tenant, p_scope, p_key, 'in_progress', p_fingerprint, p_token,
                    v_now + p_lease_ms, v_now + p_ttl_ms, v_now, v_now, 1, v_now, FALSE)
            ON CONFLICT (tenant, scope, key) DO NOTHING;
            IF FOUND THEN
                outcome := 'acquired';
                attempt_number := 1;
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
                    expires_at = v_now + p_ttl_ms, created_at = v_now, updated_at = v_now,
                    attempt = 1, attempt_started_at = v_now, recovered = FALSE
                 WHERE tenant = p_tenant AND scope = p_scope AND key = p_key;
                outcome := 'acquired';
                attempt_number := 1;
            WHEN 'takeover' THEN
                UPDATE idempotency_records SET
                    fingerprint = p_fingerprint, owner_token = p_token,
                    lease_expires_at = v_now + p_lease_ms, expires_at = v_now + p_ttl_ms,
                    updated_at = v_now, attempt = r.attempt + 1, attempt_started_at = v_now
                 WHERE tenant = p_tenant AND scope = p_scope AND key = p_key;
                outcome := 'acquired';
                took_over := TRUE;
                attempt_number := r.attempt + 1;
                previous_attempt_started_at := COALESCE(r.attempt_started_at, r.created_at);
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
        PERFORM set_config('lock_timeout', v_old_lock_timeout, TRUE);
    EXCEPTION WHEN lock_not_available THEN
        -- Another transaction holds the row (a transactional-mode owner whose
        -- body is running): that is a call in progress. Its remaining time is
        -- unknown; the requested lease is the estimate.
        outcome := 'in_progress';
        took_over := FALSE;
        attempt_number := NULL;
        previous_attempt_started_at := NULL;
        lease_remaining_ms := p_lease_ms;
    END;
END
$$;

-- Store mode: the decisions of 0002 (no subtransaction), keeping the attempt number.
CREATE FUNCTION idempotency_reserve_autocommit(
    p_tenant TEXT, p_scope TEXT, p_key TEXT, p_fingerprint TEXT, p_token TEXT,
    p_lease_ms BIGINT, p_ttl_ms BIGINT, p_lock_wait_ms BIGINT,
    OUT outcome TEXT, OUT took_over BOOLEAN, OUT is_error BOOLEAN, OUT result BYTEA,
    OUT lease_remaining_ms BIGINT, OUT attempt_number INT,
    OUT previous_attempt_started_at BIGINT)
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
             expires_at, created_at, updated_at, attempt, attempt_started_at, recovered)
        VALUES (p_tenant, p_scope, p_key, 'in_progress', p_fingerprint, p_token,
                v_now + p_lease_ms, v_now + p_ttl_ms, v_now, v_now, 1, v_now, FALSE)
        ON CONFLICT (tenant, scope, key) DO NOTHING;
        IF FOUND THEN
            outcome := 'acquired';
            attempt_number := 1;
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
                expires_at = v_now + p_ttl_ms, created_at = v_now, updated_at = v_now,
                attempt = 1, attempt_started_at = v_now, recovered = FALSE
             WHERE tenant = p_tenant AND scope = p_scope AND key = p_key;
            outcome := 'acquired';
            attempt_number := 1;
        WHEN 'takeover' THEN
            UPDATE idempotency_records SET
                fingerprint = p_fingerprint, owner_token = p_token,
                lease_expires_at = v_now + p_lease_ms, expires_at = v_now + p_ttl_ms,
                updated_at = v_now, attempt = r.attempt + 1, attempt_started_at = v_now
             WHERE tenant = p_tenant AND scope = p_scope AND key = p_key;
            outcome := 'acquired';
            took_over := TRUE;
            attempt_number := r.attempt + 1;
            previous_attempt_started_at := COALESCE(r.attempt_started_at, r.created_at);
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
