-- idempotency_purge: a purge that skips rows held by open transactions
-- (DESIGN.md rule 16). Statements are separated by lines reading `-- @@statement`.
DROP PROCEDURE IF EXISTS idempotency_purge
-- @@statement
-- Deletes up to p_batch expired records (an in-progress one only when both its
-- lease and its retention ran out) and answers how many. Rows locked by open
-- transactions are skipped (SELECT ... FOR UPDATE SKIP LOCKED), never waited
-- for: a row held by an open transaction does not stall the purge of the
-- others. The batch is selected and deleted by primary key in one short
-- transaction, expiry checked again on delete.
CREATE PROCEDURE idempotency_purge(IN p_batch BIGINT)
BEGIN
    DECLARE v_now BIGINT;
    DECLARE v_done TINYINT DEFAULT 0;
    DECLARE v_deleted BIGINT DEFAULT 0;
    DECLARE v_tenant VARBINARY(255);
    DECLARE v_scope VARBINARY(255);
    DECLARE v_key VARBINARY(255);
    DECLARE c_batch CURSOR FOR
        SELECT tenant, scope, `key` FROM idempotency_records
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
