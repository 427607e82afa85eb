-- Waiting duplicates are also woken when a lease is shortened.
--
-- A running call's owner can end its lease early (a heartbeat with a lease
-- shorter than what is left; the engine does this when a `recover` hook's
-- answer is not recorded, so the next call takes the record over at once).
-- The trigger of 0004 notified only on a change of state or owner, so a
-- duplicate already waiting slept until the end of the lease it had seen
-- (or its wait bound) before looking again. Renewals lengthen the lease and
-- still notify nobody.
DROP TRIGGER IF EXISTS idempotency_records_wake_on_update ON idempotency_records;
CREATE TRIGGER idempotency_records_wake_on_update
    AFTER UPDATE ON idempotency_records
    FOR EACH ROW
    WHEN (OLD.waiting AND (NEW.state IS DISTINCT FROM OLD.state
                           OR NEW.owner_token IS DISTINCT FROM OLD.owner_token
                           OR NEW.lease_expires_at < OLD.lease_expires_at))
    EXECUTE FUNCTION idempotency_notify_waiters();
