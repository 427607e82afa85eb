-- The idempotency records of idempotent-runtime's MySqlStore (MySQL 8 / MariaDB 10.6+).
--
-- One row per (tenant, scope, key). Tenant, scope and key are VARBINARY: they
-- match byte for byte, with no collation, case folding or trailing-space
-- padding. Times are BIGINT milliseconds since the epoch on the database's
-- clock. Statements in this file are separated by lines reading `-- @@statement`
-- (the store's migration runner splits on them; no client DELIMITER needed).
CREATE TABLE IF NOT EXISTS idempotency_records (
    tenant           VARBINARY(255) NOT NULL,
    scope            VARBINARY(255) NOT NULL,
    `key`            VARBINARY(255) NOT NULL,
    state            VARCHAR(16) CHARACTER SET ascii NOT NULL,
    fingerprint      VARBINARY(255) NULL,
    owner_token      VARBINARY(64) NULL,
    is_error         TINYINT(1) NOT NULL DEFAULT 0,
    result           LONGBLOB NULL,
    lease_expires_at BIGINT NULL,
    expires_at       BIGINT NOT NULL,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    PRIMARY KEY (tenant, scope, `key`),
    KEY idempotency_records_expires_at (expires_at)
) ENGINE = InnoDB
-- @@statement
DROP PROCEDURE IF EXISTS idempotency_reserve
-- @@statement
-- Answers a reservation in one CALL: acquire, replace an expired record, take
-- over an expired lease, replay, in progress or mismatch.
--
-- The first statement inserts the record or, when it exists, takes an
-- exclusive lock on it without changing it (ON DUPLICATE KEY UPDATE no-op);
-- the row is then read under that lock and the decision made. p_own_tx = 1
-- wraps the work in a transaction of its own (the store's pool); p_own_tx = 0
-- runs in the caller's transaction (transactional mode). A lock held by
-- another transaction is waited for at most p_lock_wait_s whole seconds
-- (innodb_lock_wait_timeout, restored afterwards); when that runs out
-- (error 1205) the answer is 'in_progress'.
CREATE PROCEDURE idempotency_reserve(
    IN p_tenant VARBINARY(255), IN p_scope VARBINARY(255), IN p_key VARBINARY(255),
    IN p_fingerprint VARBINARY(255), IN p_token VARBINARY(64),
    IN p_lease_ms BIGINT, IN p_ttl_ms BIGINT, IN p_lock_wait_s BIGINT, IN p_own_tx TINYINT)
BEGIN
    DECLARE v_now BIGINT;
    DECLARE v_state VARCHAR(16);
    DECLARE v_fp VARBINARY(255);
    DECLARE v_token VARBINARY(64);
    DECLARE v_is_error TINYINT DEFAULT 0;
    DECLARE v_result LONGBLOB DEFAULT NULL;
    DECLARE v_lease BIGINT;
    DECLARE v_expires BIGINT;
    DECLARE v_outcome VARCHAR(16) DEFAULT NULL;
    DECLARE v_took_over TINYINT DEFAULT 0;
    DECLARE v_lease_remaining BIGINT DEFAULT NULL;
    DECLARE v_attempt INT DEFAULT 0;
    DECLARE v_timed_out TINYINT DEFAULT 0;
    DECLARE v_found TINYINT DEFAULT 1;
    DECLARE v_old_wait BIGINT DEFAULT @@SESSION.innodb_lock_wait_timeout;
    DECLARE CONTINUE HANDLER FOR 1205 SET v_timed_out = 1;
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        SET SESSION innodb_lock_wait_timeout = v_old_wait;
        IF p_own_tx = 1 THEN
            ROLLBACK;
        END IF;
        RESIGNAL;
    END;

    SET SESSION innodb_lock_wait_timeout = p_lock_wait_s;
    IF p_own_tx = 1 THEN
        START TRANSACTION;
    END IF;
    WHILE v_outcome IS NULL AND v_timed_out = 0 DO
        SET v_attempt = v_attempt + 1;
        IF v_attempt > 50 THEN
            SIGNAL SQLSTATE '45000'
                SET MESSAGE_TEXT = 'idempotency_reserve: the record kept changing under this reservation; retry';
        END IF;
        SET v_now = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000);
        INSERT INTO idempotency_records
            (tenant, scope, `key`, state, fingerprint, owner_token, is_error, result,
             lease_expires_at, expires_at, created_at, updated_at)
        VALUES (p_tenant, p_scope, p_key, 'in_progress', p_fingerprint, p_token, 0, NULL,
                v_now + p_lease_ms, v_now + p_ttl_ms, v_now, v_now)
        ON DUPLICATE KEY UPDATE tenant = tenant;
        IF v_timed_out = 0 THEN
            SET v_found = 1;
            SELECT state, fingerprint, owner_token, is_error, result, lease_expires_at, expires_at
              INTO v_state, v_fp, v_token, v_is_error, v_result, v_lease, v_expires
              FROM idempotency_records
             WHERE tenant = p_tenant AND scope = p_scope AND `key` = p_key
               FOR UPDATE;
            SET v_now = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000);
            IF v_timed_out = 1 OR v_found = 0 THEN
                SET v_outcome = NULL;
            ELSEIF v_state = 'in_progress' AND v_token = p_token THEN
                SET v_outcome = 'acquired';
            ELSEIF v_expires <= v_now AND (v_state = 'complete' OR v_lease <= v_now) THEN
                UPDATE idempotency_records SET
                    state = 'in_progress', fingerprint = p_fingerprint, owner_token = p_token,
                    is_error = 0, result = NULL, lease_expires_at = v_now + p_lease_ms,
                    expires_at = v_now + p_ttl_ms, created_at = v_now, updated_at = v_now
                 WHERE tenant = p_tenant AND scope = p_scope AND `key` = p_key;
                SET v_outcome = 'acquired', v_is_error = 0, v_result = NULL;
            ELSEIF v_fp IS NOT NULL AND p_fingerprint IS NOT NULL AND v_fp <> p_fingerprint THEN
                SET v_outcome = 'mismatch', v_is_error = 0, v_result = NULL;
            ELSEIF v_state = 'complete' THEN
                SET v_outcome = 'completed';
            ELSEIF v_lease > v_now THEN
                SET v_outcome = 'in_progress', v_lease_remaining = v_lease - v_now,
                    v_is_error = 0, v_result = NULL;
            ELSE
                UPDATE idempotency_records SET
                    fingerprint = p_fingerprint, owner_token = p_token,
                    lease_expires_at = v_now + p_lease_ms, expires_at = v_now + p_ttl_ms,
                    updated_at = v_now
                 WHERE tenant = p_tenant AND scope = p_scope AND `key` = p_key;
                SET v_outcome = 'acquired', v_took_over = 1, v_is_error = 0, v_result = NULL;
            END IF;
        END IF;
    END WHILE;
    IF p_own_tx = 1 THEN
        IF v_timed_out = 1 THEN
            ROLLBACK;
        ELSE
            COMMIT;
        END IF;
    END IF;
    SET SESSION innodb_lock_wait_timeout = v_old_wait;
    IF v_timed_out = 1 THEN
        -- Another transaction holds the row (a transactional-mode owner whose
        -- body is running): a call in progress, its remaining time unknown.
        SET v_outcome = 'in_progress', v_lease_remaining = p_lease_ms,
            v_took_over = 0, v_is_error = 0, v_result = NULL;
    END IF;
    SELECT v_outcome AS outcome, v_took_over AS took_over, v_is_error AS is_error,
           v_result AS result, v_lease_remaining AS lease_remaining_ms;
END
