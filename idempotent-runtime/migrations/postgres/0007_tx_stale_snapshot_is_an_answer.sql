-- Transactional mode under REPEATABLE READ or SERIALIZABLE: a record another
-- transaction committed after the caller's snapshot no longer aborts the
-- caller's transaction.
--
-- Inserting a key whose row was committed after the snapshot (or updating
-- such a row) fails with serialization_failure (40001). 0006's wrapper caught
-- only lock timeouts, so the error escaped its subtransaction and aborted the
-- caller's whole transaction (every later statement: 25P02). Now it is caught
-- like a lock timeout, the subtransaction's work and locks are undone, and the
-- answer is 'stale_snapshot' (the store answers Error::StaleSnapshot: roll
-- back and retry in a new transaction, which replays the record). Otherwise
-- the function is 0006's.
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
        WHEN serialization_failure THEN
            -- REPEATABLE READ or SERIALIZABLE: another transaction committed
            -- this record after the caller's snapshot was taken. The caller
            -- can neither see it nor write it; only a new transaction can.
            -- Answered, with the subtransaction undone, so the caller's
            -- transaction stays usable.
            outcome := 'stale_snapshot';
            took_over := FALSE;
            is_error := NULL;
            result := NULL;
            lease_remaining_ms := NULL;
            attempt_number := NULL;
            previous_attempt_started_at := NULL;
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
