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
-- body again. The store's own statements name the schema it finds its table
-- in when it opens; these functions keep to that schema, with `pg_temp`
-- searched last, not first.
--
-- The schema is the one `idempotency_records` resolves to, as the store's
-- open finds it, not `current_schema()`: a database an earlier build migrated
-- when the search_path's first schema did not exist yet (a `"$user"` schema
-- created later, an application schema put in front of `public`) has the
-- table and its functions further down the path, and pinning the functions of
-- the first schema would pin none of the store's. The schema is compared by
-- its oid, never by its name read as an identifier (`MyApp` would be read as
-- `myapp`, another schema or none).
--
-- Only the functions that touch the table or call the store's other
-- functions: `idempotency_now_ms` and `idempotency_wait_key` use built-in
-- functions alone (the system catalog is searched first), and a function with
-- a setting of its own is never inlined into the statement that calls it.
DO $$
DECLARE
    v_schema OID;
    v_name NAME;
    v_temp BOOLEAN;
    f REGPROCEDURE;
BEGIN
    SELECT n.oid, n.nspname, n.oid = pg_my_temp_schema()
      INTO v_schema, v_name, v_temp
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = to_regclass('idempotency_records');
    IF v_schema IS NULL THEN
        RAISE EXCEPTION 'no table idempotency_records on the search_path: check the search_path of the pool''s connections';
    END IF;
    IF v_temp THEN
        RAISE EXCEPTION 'a TEMP table named idempotency_records hides the store''s table on this connection; drop it (or open the store on a pool whose connections have none)';
    END IF;
    FOR f IN
        SELECT p.oid::REGPROCEDURE
          FROM pg_proc p
         WHERE p.pronamespace = v_schema
           AND p.proname IN ('idempotency_acquire_absent', 'idempotency_reserve_core',
                             'idempotency_reserve_autocommit', 'idempotency_reserve',
                             'idempotency_notify_waiters')
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, v_name);
    END LOOP;
END
$$;
