-- idempotency_purge reads its batch through the expiry index (DESIGN.md
-- rule 16). On a small table the optimizer chose a full scan for the cursor,
-- and then `FOR UPDATE SKIP LOCKED` tested only the rows themselves: an
-- expired record whose `idempotency_records_expires_at` entry another
-- transaction held (an index-only `... LOCK IN SHARE MODE`) was not skipped,
-- and the `DELETE`, which marks that entry too, waited for it for
-- `innodb_lock_wait_timeout` and then failed the whole batch. Read through
-- the index, the cursor locks (or skips) the index entry and the row both,
-- and the `DELETE` has nothing left to wait for. Otherwise as in 0003. MySQL
-- 8 has no CREATE OR REPLACE PROCEDURE: a CALL in the instant between the
-- drop and the create fails with "does not exist" (a store error; the next
-- purge runs). Statements are separated by lines reading `-- @@statement`.
DROP PROCEDURE IF EXISTS idempotency_purge
-- @@statement
-- Deletes up to p_batch expired records (an in-progress one only when both its
-- lease and its retention ran out) and answers how many, skipping rows and
-- index entries held by open transactions (never waited for).
CREATE PROCEDURE idempotency_purge(IN p_batch BIGINT)
BEGIN
    DECLARE v_now BIGINT;
    DECLARE v_done TINYINT DEFAULT 0;
    DECLARE v_deleted BIGINT DEFAULT 0;
    DECLARE v_tenant VARBINARY(255);
    DECLARE v_scope VARBINARY(255);
    DECLARE v_key VARBINARY(255);
    DECLARE c_batch CURSOR FOR
        SELECT tenant, scope, `key`
          FROM idempotency_records FORCE INDEX (idempotency_records_expires_at)
         WHERE expires_at <= v_now AND (state = 'complete' OR lease_expires_at <= v_now)
         ORDER BY expires_at
         LIMIT p_batch
           FOR UPDATE SKIP LOCKED;
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_done = 1;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;

    SET v_now = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000);
    START TRANSACTION;
    OPEN c_batch;
    each_row: LOOP
        FETCH c_batch INTO v_tenant, v_scope, v_key;
        IF v_done = 1 THEN
            LEAVE each_row;
        END IF;
        DELETE FROM idempotency_records
         WHERE tenant = v_tenant AND scope = v_scope AND `key` = v_key
           AND expires_at <= v_now AND (state = 'complete' OR lease_expires_at <= v_now);
        SET v_deleted = v_deleted + ROW_COUNT();
    END LOOP each_row;
    CLOSE c_batch;
    COMMIT;
    SELECT v_deleted AS deleted;
END
