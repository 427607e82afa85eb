-- One reservation body, and waking waiting duplicates.
--
-- 1. The two reservation functions of 0003 repeated one body. The decisions
--    now live in idempotency_reserve_core, and the two functions callers know
--    (same names, same arguments, same OUT columns, so processes running an
--    older idempotent-runtime keep working against this schema) are thin
--    wrappers over it:
--    * idempotency_reserve_autocommit (store mode): the body as is. It sets
--      lock_timeout for its own transaction (the statement's), and a lock
--      timeout fails the statement with lock_not_available (SQLSTATE 55P03),
--      which the store answers as in progress.
--    * idempotency_reserve (transactional mode, in a caller's transaction):
--      the body in a subtransaction that catches the lock timeout and
--      restores the caller's lock_timeout, so the caller's transaction stays
--      usable.
--    PgStore answers replays, refusals and mismatches (and, in store mode,
--    fresh keys) with one plain SQL statement and calls these functions only
--    for what needs a decision under a row lock: replacing an expired record,
--    taking over an expired lease, or a race with a concurrent reservation.
--
-- 2. Waiting duplicates (LISTEN/NOTIFY). A duplicate that decides to wait for
--    an in-progress record first LISTENs on the channel `idempotency_records`
--    (one listener connection per store), then marks the record
--    (`waiting = TRUE`). When a marked record completes, is released, deleted,
--    or changes owner, the trigger below sends the record's wait key (a
--    digest of its identity, see idempotency_wait_key) on that channel. The
--    notification goes out when the writing transaction commits (a
--    transactional-mode completion notifies at its caller's commit, not
--    before; a rollback notifies nobody). Records nobody waits for never
--    notify: NOTIFY takes a database-wide lock at commit, which the fresh
--    path must not pay. Every writer is covered, whatever its version
--    (completion, release, operator release, purge, takeover), because the
--    trigger is in the table, not in the statements.
ALTER TABLE idempotency_records
    ADD COLUMN IF NOT EXISTS waiting BOOLEAN NOT NULL DEFAULT FALSE;

-- The payload of a record's notification: a digest of its identity (the
-- identity itself could exceed NOTIFY's 8000-byte payload limit). The parts
-- are length-prefixed, so two identities give two different strings before
-- hashing. A collision would only wake a waiter early, which is harmless:
-- a woken waiter reserves again.
CREATE OR REPLACE FUNCTION idempotency_wait_key(p_tenant TEXT, p_scope TEXT, p_key TEXT)
RETURNS TEXT
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT encode(sha256(convert_to(
        length(p_tenant)::TEXT || ':' || p_tenant || length(p_scope)::TEXT || ':' || p_scope || p_key,
        'UTF8')), 'hex')
$$;

CREATE OR REPLACE FUNCTION idempotency_notify_waiters() RETURNS TRIGGER
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idempotency_records', idempotency_wait_key(OLD.tenant, OLD.scope, OLD.key));
    RETURN NULL;
END
$$;

-- The WHEN conditions are evaluated as each row is written; only a row a
-- waiter marked queues an event (and so a NOTIFY).
CREATE TRIGGER idempotency_records_wake_on_update
    AFTER UPDATE ON idempotency_records
    FOR EACH ROW
    WHEN (OLD.waiting AND (NEW.state IS DISTINCT FROM OLD.state
                           OR NEW.owner_token IS DISTINCT FROM OLD.owner_token))
    EXECUTE FUNCTION idempotency_notify_waiters();
CREATE TRIGGER idempotency_records_wake_on_delete
    AFTER DELETE ON idempotency_records
    FOR EACH ROW
    WHEN (OLD.waiting)
    EXECUTE FUNCTION idempotency_notify_waiters();

-- The one reservation body: acquire, replace an expired record, take over an
-- expired lease, replay, in progress, or mismatch. Waits at most
-- p_lock_wait_ms for a row locked by another transaction (lock_timeout, set
-- for the current transaction: the wrappers decide what a timeout means).
-- A record that is replaced or taken over starts without waiters (the
-- trigger has just woken the old ones; they mark the record again).
CREATE OR REPLACE FUNCTION idempotency_reserve_core(
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
                attempt = 1, attempt_started_at = v_now, recovered = FALSE, waiting = FALSE
             WHERE tenant = p_tenant AND scope = p_scope AND key = p_key;
            outcome := 'acquired';
            attempt_number := 1;
        WHEN 'takeover' THEN
            UPDATE idempotency_records SET
                fingerprint = p_fingerprint, owner_token = p_token,
                lease_expires_at = v_now + p_lease_ms, expires_at = v_now + p_ttl_ms,
                updated_at = v_now, attempt = r.attempt + 1, attempt_started_at = v_now,
                waiting = FALSE
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

-- Store mode: the body as is (the statement is its own transaction).
CREATE OR REPLACE FUNCTION idempotency_reserve_autocommit(
    p_tenant TEXT, p_scope TEXT, p_key TEXT, p_fingerprint TEXT, p_token TEXT,
    p_lease_ms BIGINT, p_ttl_ms BIGINT, p_lock_wait_ms BIGINT,
    OUT outcome TEXT, OUT took_over BOOLEAN, OUT is_error BOOLEAN, OUT result BYTEA,
    OUT lease_remaining_ms BIGINT, OUT attempt_number INT,
    OUT previous_attempt_started_at BIGINT)
LANGUAGE sql VOLATILE AS $$
    SELECT * FROM idempotency_reserve_core(p_tenant, p_scope, p_key, p_fingerprint, p_token,
                                           p_lease_ms, p_ttl_ms, p_lock_wait_ms)
$$;

-- Transactional mode: the body in a subtransaction, so a lock timeout leaves
-- the caller's transaction usable, and the caller's lock_timeout restored.
CREATE OR REPLACE FUNCTION idempotency_reserve(
    p_tenant TEXT, p_scope TEXT, p_key TEXT, p_fingerprint TEXT, p_token TEXT,
    p_lease_ms BIGINT, p_ttl_ms BIGINT, p_lock_wait_ms BIGINT,
    OUT outcome TEXT, OUT took_over BOOLEAN, OUT is_error BOOLEAN, OUT result BYTEA,
    OUT lease_remaining_ms BIGINT, OUT attempt_number INT,
    OUT previous_attempt_started_at BIGINT)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_old_lock_timeout TEXT := current_setting('lock_timeout');
BEGIN
    BEGIN
        SELECT c.outcome, c.took_over, c.is_error, c.result, c.lease_remaining_ms,
               c.attempt_number, c.previous_attempt_started_at
          INTO outcome, took_over, is_error, result, lease_remaining_ms,
               attempt_number, previous_attempt_started_at
          FROM idempotency_reserve_core(p_tenant, p_scope, p_key, p_fingerprint, p_token,
                                        p_lease_ms, p_ttl_ms, p_lock_wait_ms) c;
        PERFORM set_config('lock_timeout', v_old_lock_timeout, TRUE);
    EXCEPTION WHEN lock_not_available THEN
        -- Another transaction holds the row (a transactional-mode owner whose
        -- body is running): that is a call in progress. Its remaining time is
        -- unknown; the requested lease is the estimate. (The subtransaction's
        -- rollback also undid the body's lock_timeout.)
        outcome := 'in_progress';
        took_over := FALSE;
        is_error := NULL;
        result := NULL;
        attempt_number := NULL;
        previous_attempt_started_at := NULL;
        lease_remaining_ms := p_lease_ms;
    END;
END
$$;
