-- Transactional mode: an answer other than "acquired" leaves no row lock in
-- the caller's transaction.
--
-- The reservation body locks the record (FOR UPDATE) when its plain read
-- saw something to write (an expired record, a lease that ran out) and then
-- decides again under the lock. When another caller got there first (its
-- takeover committed while this one waited for the lock), the decision is
-- "in progress", "completed" or "mismatch", but in 0004's wrapper the lock
-- stayed with the caller's transaction until it ended: the new owner could
-- neither renew its lease nor record its result meanwhile, and a duplicate
-- waiting in that transaction could see the starved lease run out and take
-- the record over beside the live owner (rules 10 and 15).
--
-- Now the body's subtransaction is rolled back unless it acquired: the
-- answer (kept in the OUT values, which a rollback does not touch) is the
-- same, and every lock the body took is released with the subtransaction.
-- The rollback also undoes the body's lock_timeout, as before.
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
        IF outcome <> 'acquired' THEN
            -- Not ours: undo the subtransaction, and with it its locks.
            RAISE EXCEPTION USING ERRCODE = 'IDEM0';
        END IF;
        PERFORM set_config('lock_timeout', v_old_lock_timeout, TRUE);
    EXCEPTION
        WHEN SQLSTATE 'IDEM0' THEN
            NULL; -- the answer is in the OUT values
        WHEN lock_not_available THEN
            -- Another transaction holds the row (a transactional-mode owner
            -- whose body is running): that is a call in progress. Its
            -- remaining time is unknown; the requested lease is the estimate.
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
