-- idempotency_purge's DELETE reaches the one record it deletes by primary
-- key (DESIGN.md rule 16). It repeated the cursor's conditions, and with
-- `expires_at <= v_now` among them MariaDB read the DELETE through the
-- expiry index whenever few records were expired (a purger that runs keeps
-- them few) on a table of some size: the range scan read the first index
-- entry past the expired ones as well, and waited for that record's row
-- lock although the record was live: its owner's transactional-mode call
-- still open (for innodb_lock_wait_timeout, 50 s by default, then the batch
-- failed with nothing purged), or its store-mode completion under way (a
-- deadlock: the completion waits for the expiry index entry the cursor
-- holds, so one of them was rolled back, and the call whose body had run
-- got a store error). Written `expires_at + 0`, the condition is still
-- checked (the cursor's row lock already holds the record as it was
-- selected) but no longer makes an index range, so the DELETE reads the
-- primary key and locks nothing it does not delete. Otherwise as in 0007.
-- Statements are separated by lines reading `-- @@statement`.
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
           AND expires_at + 0 <= v_now AND (state = 'complete' OR lease_expires_at <= v_now);
        SET v_deleted = v_deleted + ROW_COUNT();
    END LOOP each_row;
    CLOSE c_batch;
    COMMIT;
    SELECT v_deleted AS deleted;
END
