-- The functions that read and write the records find them in their own
-- schema, whatever the calling session's search_path says.
--
-- A plpgsql function resolves the table and function names it uses by the
-- search_path of the session that calls it. A connection of a pool the store
-- shares can be left with another one: code that switches schemas per
-- request (`SET search_path = tenant_a`), in a database where that schema has
-- the store's tables too; or a TEMP table named `idempotency_records`, which
-- PostgreSQL looks at before any schema. The reservation then wrote the
-- record where the store's other sessions never look, and a retry ran the
-- body again. The store's own statements name the schema it found its table
-- in when it opened; these functions keep to the schema they were created in,
-- with `pg_temp` searched last, not first.
--
-- Only the functions that touch the table or call the store's other
-- functions: `idempotency_now_ms` and `idempotency_wait_key` use built-in
-- functions alone (the system catalog is searched first), and a function with
-- a setting of its own is never inlined into the statement that calls it.
DO $$
DECLARE
    f REGPROCEDURE;
BEGIN
    FOR f IN
        SELECT p.oid::REGPROCEDURE
          FROM pg_proc p
         WHERE p.pronamespace = current_schema()::REGNAMESPACE
           AND p.proname IN ('idempotency_acquire_absent', 'idempotency_reserve_core',
                             'idempotency_reserve_autocommit', 'idempotency_reserve',
                             'idempotency_notify_waiters')
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
    END LOOP;
END
$$;
