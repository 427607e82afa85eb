-- Store mode's reservation reads before it writes.
--
-- Until now the store's statement carried an INSERT … ON CONFLICT DO NOTHING
-- in a data-modifying CTE. PostgreSQL sets an INSERT up (the table, its
-- indexes, the arbiter index) every time the statement runs, also when the
-- record exists and nothing is inserted: a replay paid for a write it never
-- made. Now the statement is a plain read of the record (a LEFT JOIN on the
-- primary key), and only when there is no record does it call this function,
-- which inserts the reservation. A replay, a refusal or a mismatch is one
-- primary-key read again.
--
-- Store mode only: it sets `lock_timeout` for the rest of the transaction,
-- which in store mode is the one statement. A row another transaction
-- inserted and has not committed (a transactional-mode owner) is waited for
-- at most p_lock_wait_ms, then the statement fails with lock_not_available
-- (55P03: the key is in progress). Answers whether it inserted the record;
-- FALSE (a concurrent reservation inserted it first) leaves the decision to
-- idempotency_reserve_autocommit, under the row lock.
CREATE OR REPLACE FUNCTION idempotency_acquire_absent(
    p_tenant TEXT, p_scope TEXT, p_key TEXT, p_fingerprint TEXT, p_token TEXT,
    p_lease_ms BIGINT, p_ttl_ms BIGINT, p_lock_wait_ms BIGINT, p_now BIGINT)
RETURNS BOOLEAN
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_lock_timeout TEXT;
BEGIN
    -- An assignment, not PERFORM: plpgsql evaluates a simple expression
    -- without a query of its own.
    v_lock_timeout := set_config('lock_timeout', greatest(p_lock_wait_ms, 1)::TEXT || 'ms', TRUE);
    INSERT INTO idempotency_records
        (tenant, scope, key, state, fingerprint, owner_token, lease_expires_at,
         expires_at, created_at, updated_at, attempt, attempt_started_at)
    VALUES (p_tenant, p_scope, p_key, 'in_progress', p_fingerprint, p_token,
            p_now + p_lease_ms, p_now + p_ttl_ms, p_now, p_now, 1, p_now)
    ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$$;
