-- The idempotency records of idempotent-runtime's PgStore.
--
-- One row per (tenant, scope, key). Times are milliseconds since the Unix epoch
-- on the database's clock (clock_timestamp(), not now(): now() is frozen at the
-- start of a transaction, and in transactional mode a reservation can sit in a
-- long caller transaction).
CREATE TABLE IF NOT EXISTS idempotency_records (
    tenant           TEXT COLLATE "C" NOT NULL,
    scope            TEXT COLLATE "C" NOT NULL,
    key              TEXT COLLATE "C" NOT NULL,
    state            TEXT NOT NULL CHECK (state IN ('in_progress', 'complete')),
    fingerprint      TEXT COLLATE "C",
    owner_token      TEXT COLLATE "C",
    is_error         BOOLEAN NOT NULL DEFAULT FALSE,
    result           BYTEA,
    lease_expires_at BIGINT,
    expires_at       BIGINT NOT NULL,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    PRIMARY KEY (tenant, scope, key)
);

-- Purging walks this index from the oldest expiry up to now.
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);

CREATE OR REPLACE FUNCTION idempotency_now_ms() RETURNS BIGINT
LANGUAGE sql VOLATILE AS $$
    SELECT (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT
$$;

-- Answers a reservation in one statement: acquire, replace an expired record,
-- take over an expired lease, replay, in progress, or mismatch.
--
-- Waits at most p_lock_wait_ms for a row locked by another transaction (a
-- transactional-mode owner's uncommitted reservation); when that runs out the
-- answer is 'in_progress' and the caller's transaction stays usable (the lock
-- timeout is caught in a subtransaction, and lock_timeout is restored).
CREATE OR REPLACE FUNCTION idempotency_reserve(
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
        PERFORM set_config('lock_timeout', v_old_lock_timeout, TRUE);
    EXCEPTION WHEN lock_not_available THEN
        -- Another transaction holds the row (a transactional-mode owner whose
        -- body is running): that is a call in progress. Its remaining time is
        -- unknown; the requested lease is the estimate.
        outcome := 'in_progress';
        took_over := FALSE;
        lease_remaining_ms := p_lease_ms;
    END;
END
$$;
