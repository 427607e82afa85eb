-- A transactional takeover is not refused on the row of an ended
-- transaction that information_schema.innodb_trx still shows (DESIGN.md
-- rule 10).
--
-- 0008 refuses a takeover, in a caller's transaction, of a lease that ran
-- out after the transaction began, reading the start from innodb_trx. InnoDB
-- shows that table through a cache it refreshes only once nobody has read the
-- table for 0.1 s; while something reads it more often (a monitoring agent,
-- other transactions' takeover checks, or the caller's own retries, each of
-- which reads it here) the cache may go on showing a transaction of the
-- session that has ended. A transaction begun after a crashed owner's lease
-- ran out was judged by that ended transaction's start, which came before,
-- and refused as stale: every new transaction on the connection, for as long
-- as the reads went on.
--
-- Now each check of innodb_trx leaves in the session variable
-- @idempotency_tx_seen the transaction's signature (0014: the session's
-- counts of BEGIN, COMMIT, ROLLBACK and XA statements), the moment before the
-- transaction began if known, and the moment (ms, the database's clock) it
-- ran. A later check under another signature knows that its transaction began
-- after that last moment, inside a transaction that has ended (and a later
-- check of the same transaction, what the earlier one knew): a row whose
-- start (whole seconds, rounded down) is at least a second before that moment
-- belongs to an earlier transaction, and counts as no row (unknown: the fence
-- and the marks of 0013 and 0014 decide, as when the table leaves the
-- transaction out); and a lease that ran out by that moment ran out before
-- the transaction began, whatever the row says (its start in whole seconds
-- also refused a transaction begun in the second the lease ran out). A retry
-- on the connection in a new transaction is then refused once more at most.
-- Without the session's status nothing is remembered, as before. Known limit,
-- as for the marks of 0014: a BEGIN, COMMIT, ROLLBACK or XA statement the
-- server refuses inside a transaction changes the signature, and the
-- transaction is then taken for one begun after its own earlier checks.
--
-- idempotency_reserve_v4 is created again, unchanged but for that (0014 and
-- the migrations it names describe the rest); v2 and v3 call it.
-- Statements are separated by lines reading `-- @@statement`.
DROP PROCEDURE IF EXISTS idempotency_reserve_v4
-- @@statement
-- Answers a reservation: acquire, replace an expired record, take over an
-- expired lease, replay, in progress or mismatch. The answer is in the OUT
-- parameters, and with p_select = 1 also one row:
-- (outcome, took_over, is_error, result, lease_remaining_ms, attempt_number,
--  previous_attempt_started_at); attempt_number is set when acquired,
-- previous_attempt_started_at on a takeover (when the attempt taken over
-- started). How it decides (a plain read first; one reserver per identity
-- under GET_LOCK on the write path; fenced writes; the waits) is described
-- in 0002, the attempt numbers in 0004.
CREATE PROCEDURE idempotency_reserve_v4(
    IN p_tenant VARBINARY(255), IN p_scope VARBINARY(255), IN p_key VARBINARY(255),
    IN p_fingerprint VARBINARY(255), IN p_token VARBINARY(64),
    IN p_lease_ms BIGINT, IN p_ttl_ms BIGINT, IN p_lock_wait_s BIGINT, IN p_own_tx TINYINT,
    IN p_select TINYINT,
    OUT o_outcome VARCHAR(16), OUT o_took_over TINYINT, OUT o_is_error TINYINT,
    OUT o_result LONGBLOB, OUT o_lease_remaining_ms BIGINT, OUT o_attempt_number INT,
    OUT o_previous_attempt_started_at BIGINT)
BEGIN
    DECLARE v_found TINYINT DEFAULT 1;
    DECLARE v_state VARCHAR(16);
    DECLARE v_fp VARBINARY(255);
    DECLARE v_token VARBINARY(64);
    DECLARE v_is_error TINYINT DEFAULT 0;
    DECLARE v_result LONGBLOB DEFAULT NULL;
    DECLARE v_lease BIGINT;
    DECLARE v_expires BIGINT;
    DECLARE v_rec_attempt INT;               -- the record's attempt number, as read
    DECLARE v_rec_attempt_started BIGINT;    -- when that attempt started, as read
    DECLARE v_rec_created BIGINT;
    DECLARE v_attempt_number INT DEFAULT NULL;      -- answered when acquired
    DECLARE v_previous_started BIGINT DEFAULT NULL; -- answered on a takeover
    DECLARE v_now BIGINT;
    DECLARE v_elapsed_ms BIGINT;
    -- What to do: an answer ('acquired', 'completed', 'in_progress',
    -- 'mismatch', 'stale_snapshot') or a write ('insert', 'replace', 'take_over').
    DECLARE v_decision VARCHAR(16);
    DECLARE v_took_over TINYINT DEFAULT 0;
    DECLARE v_lease_remaining BIGINT DEFAULT NULL;
    DECLARE v_latest TINYINT DEFAULT 0;
    DECLARE v_dup TINYINT DEFAULT 0;
    DECLARE v_inserted TINYINT DEFAULT 0;  -- this CALL's INSERT made the record
    DECLARE v_timed_out TINYINT DEFAULT 0;  -- an InnoDB lock wait ran out (1205)
    DECLARE v_busy TINYINT DEFAULT 0;       -- the GET_LOCK wait ran out
    DECLARE v_locked TINYINT DEFAULT 0;
    DECLARE v_lock_name VARCHAR(64);
    DECLARE v_got BIGINT;
    DECLARE v_wait_started DATETIME(6) DEFAULT NULL; -- the wait's bound counts from it (the first GET_LOCK, or in transactional mode the CALL's start)
    DECLARE v_call_started DATETIME(6) DEFAULT NULL; -- transactional mode: before the first read
    DECLARE v_left_s BIGINT;                         -- whole seconds left of the wait
    DECLARE v_slices TINYINT DEFAULT 0;              -- row locks are waited for a second at a time (see the top)
    DECLARE v_attempt INT DEFAULT 0;
    DECLARE v_rows BIGINT;
    DECLARE v_old_wait BIGINT DEFAULT NULL;
    DECLARE v_old_autocommit BIGINT DEFAULT NULL;
    DECLARE v_in_tx TINYINT DEFAULT 0;             -- a caller's transaction holds what this CALL locks
    DECLARE v_trx_checked TINYINT DEFAULT 0;       -- the transaction's start was asked for
    DECLARE v_trx_started_ms BIGINT DEFAULT NULL;  -- when it began (ms, rounded down), if known
    DECLARE v_version CHAR(32) DEFAULT NULL;       -- the mark of the version read (see the top of 0014)
    DECLARE v_tx_signature VARCHAR(255) DEFAULT NULL; -- the transaction's signature, once read
    DECLARE v_before_tx BIGINT DEFAULT NULL;       -- a moment before the transaction began, if known (see the top of 0015)
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
    DECLARE CONTINUE HANDLER FOR 1062 SET v_dup = 1;
    DECLARE CONTINUE HANDLER FOR 1205 SET v_timed_out = 1;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        IF v_locked = 1 THEN
            DO RELEASE_LOCK(v_lock_name);
        END IF;
        IF v_old_wait IS NOT NULL THEN
            SET SESSION innodb_lock_wait_timeout = v_old_wait;
        END IF;
        IF v_old_autocommit IS NOT NULL THEN
            SET SESSION autocommit = v_old_autocommit;
        END IF;
        RESIGNAL;
    END;

    IF p_tenant IS NULL OR p_scope IS NULL OR p_key IS NULL THEN
        SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT =
            'idempotency_reserve: tenant, scope or key is NULL; sql_mode EMPTY_STRING_IS_NULL turns the shared tenant into NULL';
    END IF;
    -- Transactional mode in a transaction (the runtime calls it only so; a
    -- direct call on an autocommit session commits each statement, and its
    -- locks end with them). MySQL 8 has no @@in_transaction: in a transaction.
    IF p_own_tx = 0 THEN
        IF @@SESSION.autocommit = 0 THEN
            SET v_in_tx = 1;
        ELSE
            BEGIN
                DECLARE CONTINUE HANDLER FOR SQLEXCEPTION SET v_in_tx = 1;
                SET v_in_tx = @@SESSION.in_transaction;
            END;
        END IF;
    END IF;
    IF p_own_tx = 1 AND @@SESSION.autocommit = 0 THEN
        -- The store's statements each commit on their own.
        SET v_old_autocommit = 0;
        SET SESSION autocommit = 1;
    END IF;
    -- A negative GET_LOCK timeout would mean forever; InnoDB waits at most 2^30 s.
    SET p_lock_wait_s = LEAST(GREATEST(COALESCE(p_lock_wait_s, 0), 0), 1073741824);
    -- Transactional mode waits for a row a second at a time, letting the
    -- GET_LOCK go in between, unless a timeout would roll the caller's
    -- whole transaction back (see the top).
    IF p_own_tx = 0 AND @@GLOBAL.innodb_rollback_on_timeout = 0 THEN
        SET v_slices = 1;
    END IF;
    -- Transactional mode: a read waits at most the call's bound. (Plain
    -- reads never wait, but under SERIALIZABLE InnoDB makes them locking
    -- reads; see the top.)
    IF p_own_tx = 0 THEN
        SET v_old_wait = @@SESSION.innodb_lock_wait_timeout;
        SET v_call_started = SYSDATE(6);
        SET SESSION innodb_lock_wait_timeout = GREATEST(1, p_lock_wait_s);
    END IF;

    slices: LOOP
    decide: LOOP
        SET v_attempt = v_attempt + 1;
        IF v_attempt > 50 THEN
            SIGNAL SQLSTATE '45000'
                SET MESSAGE_TEXT = 'idempotency_reserve: the record kept changing under this reservation; retry';
        END IF;

        -- Read: a plain consistent read, or after a write that did not take
        -- effect the latest committed version (the store's autocommit
        -- statements read it plainly; a caller's transaction may hold an
        -- older snapshot, so it reads under a shared lock, which its failed
        -- write already holds).
        SET v_found = 1;
        IF v_latest = 1 AND p_own_tx = 0 THEN
            SELECT state, fingerprint, owner_token, is_error, result, lease_expires_at, expires_at,
                   attempt, attempt_started_at, created_at
              INTO v_state, v_fp, v_token, v_is_error, v_result, v_lease, v_expires,
                   v_rec_attempt, v_rec_attempt_started, v_rec_created
              FROM idempotency_records
             WHERE tenant = p_tenant AND scope = p_scope AND `key` = p_key
              LOCK IN SHARE MODE;
            IF v_timed_out = 1 THEN
                LEAVE decide;
            END IF;
        ELSE
            SELECT state, fingerprint, owner_token, is_error, result, lease_expires_at, expires_at,
                   attempt, attempt_started_at, created_at
              INTO v_state, v_fp, v_token, v_is_error, v_result, v_lease, v_expires,
                   v_rec_attempt, v_rec_attempt_started, v_rec_created
              FROM idempotency_records
             WHERE tenant = p_tenant AND scope = p_scope AND `key` = p_key;
            -- Under SERIALIZABLE a locking read (see the top) whose wait ran out.
            IF v_timed_out = 1 THEN
                LEAVE decide;
            END IF;
        END IF;
        SET v_now = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000);
        -- Transactional mode: the mark of the in-progress version read (see
        -- the top of 0014).
        IF v_in_tx = 1 AND v_found = 1 AND v_state = 'in_progress' THEN
            SET v_version = LEFT(SHA2(CONCAT(
                LENGTH(p_tenant), ':', p_tenant, LENGTH(p_scope), ':', p_scope,
                LENGTH(p_key), ':', p_key, ':', HEX(COALESCE(v_token, '')), ':', COALESCE(v_lease, '')),
                256), 32);
        END IF;

        -- Decide on what was read.
        IF v_found = 0 THEN
            SET v_decision = 'insert';
        ELSEIF v_inserted = 1 AND v_state = 'in_progress' AND v_token = p_token THEN
            -- Only a record this CALL inserted is ours by its token: a caller
            -- presenting a token that already owns the record is judged like
            -- any other request (fingerprint, lease, ttl).
            SET v_decision = 'acquired', v_attempt_number = 1;
        ELSEIF v_expires <= v_now AND (v_state = 'complete' OR v_lease <= v_now) THEN
            SET v_decision = 'replace';
        ELSEIF v_fp IS NOT NULL AND p_fingerprint IS NOT NULL AND v_fp <> p_fingerprint THEN
            SET v_decision = 'mismatch';
        ELSEIF v_state = 'complete' THEN
            SET v_decision = 'completed';
        ELSEIF v_lease > v_now THEN
            SET v_decision = 'in_progress', v_lease_remaining = v_lease - v_now;
        ELSE
            SET v_decision = 'take_over';
        END IF;
        -- Transactional mode: a version this transaction locked while it
        -- was in progress is not its to take over (see the top of 0014).
        IF v_in_tx = 1 AND v_state = 'in_progress' AND v_decision IN ('take_over', 'replace')
           AND @idempotency_tx_locked IS NOT NULL THEN
            IF @idempotency_tx_locked LIKE '%/*'
               OR LOCATE(CONCAT(',', v_version, ','), @idempotency_tx_locked) > 0 THEN
                CALL idempotency_tx_signature(v_tx_signature);
                IF v_tx_signature IS NOT NULL
                   AND SUBSTRING_INDEX(@idempotency_tx_locked, '/', 1) = v_tx_signature THEN
                    SET v_decision = 'stale_snapshot';
                ELSEIF v_tx_signature IS NOT NULL THEN
                    -- Marks of a transaction that has ended.
                    SET @idempotency_tx_locked = NULL;
                END IF;
            END IF;
        END IF;
        -- Transactional mode: a lease that ran out after the transaction
        -- began is not this transaction's to take over (see the top).
        IF v_in_tx = 1 AND v_state = 'in_progress' AND v_decision IN ('take_over', 'replace') THEN
            IF v_trx_checked = 0 THEN
                SET v_trx_checked = 1;
                BEGIN
                    -- No row, or no PROCESS privilege for the procedure's
                    -- definer: unknown, and the fence alone decides.
                    DECLARE v_session_zone VARCHAR(64) DEFAULT @@SESSION.time_zone;
                    DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_trx_started_ms = NULL;
                    DECLARE CONTINUE HANDLER FOR SQLEXCEPTION SET v_trx_started_ms = NULL;
                    -- trx_started is the server's local time (the operating
                    -- system's zone), whatever the session's: read it there.
                    SET SESSION time_zone = 'SYSTEM';
                    SELECT UNIX_TIMESTAMP(trx_started) * 1000 INTO v_trx_started_ms
                      FROM information_schema.innodb_trx
                     WHERE trx_mysql_thread_id = CONNECTION_ID() LIMIT 1;
                    SET SESSION time_zone = v_session_zone;
                END;
                -- A row of a transaction that began before this one did
                -- (InnoDB's cache of the table still shows the session's
                -- ended transaction) says nothing of this one: unknown, as
                -- when the table leaves it out (see the top of 0015).
                IF v_tx_signature IS NULL THEN
                    CALL idempotency_tx_signature(v_tx_signature);
                END IF;
                IF v_tx_signature IS NOT NULL THEN
                    IF @idempotency_tx_seen IS NOT NULL
                       AND SUBSTRING_INDEX(@idempotency_tx_seen, '/', 1) <> v_tx_signature THEN
                        -- The last check of an ended transaction.
                        SET v_before_tx = CAST(SUBSTRING_INDEX(@idempotency_tx_seen, '/', -1) AS SIGNED);
                    ELSEIF @idempotency_tx_seen IS NOT NULL THEN
                        -- What an earlier check of this transaction knew.
                        SET v_before_tx = CAST(NULLIF(SUBSTRING_INDEX(SUBSTRING_INDEX(
                            @idempotency_tx_seen, '/', 2), '/', -1), '') AS SIGNED);
                    END IF;
                    -- trx_started is in whole seconds, rounded down.
                    IF v_trx_started_ms IS NOT NULL AND v_before_tx IS NOT NULL
                       AND v_trx_started_ms + 1000 <= v_before_tx THEN
                        SET v_trx_started_ms = NULL;
                    END IF;
                    SET @idempotency_tx_seen = CONCAT(v_tx_signature, '/', COALESCE(v_before_tx, ''), '/', v_now);
                END IF;
            END IF;
            -- Nor one that ran out before a moment the transaction began
            -- after (see the top of 0015).
            IF v_trx_started_ms IS NOT NULL AND v_lease >= v_trx_started_ms
               AND (v_before_tx IS NULL OR v_lease > v_before_tx) THEN
                SET v_decision = 'stale_snapshot';
            END IF;
        END IF;
        -- Transactional mode, after a write of this call that did not take
        -- effect: the transaction holds a lock on the row (the failed write's,
        -- the locking re-read's), which must not outlive an answer about an
        -- in-progress record, in progress or a mismatch (see the top).
        -- Nor, on the version read after it (the latest), a takeover or a
        -- replacement of an in-progress record: that lease may have run out
        -- waiting for this transaction's lock (see the top of 0013).
        IF v_in_tx = 1 AND v_latest = 1 AND v_state = 'in_progress'
           AND v_decision IN ('in_progress', 'mismatch', 'take_over', 'replace') THEN
            SET v_decision = 'stale_snapshot';
        END IF;
        IF v_decision IN ('acquired', 'completed', 'mismatch', 'in_progress', 'stale_snapshot') THEN
            LEAVE decide;
        END IF;

        -- Enter the write path: one reserver of this identity at a time.
        IF v_locked = 0 THEN
            SET v_lock_name = CONCAT('idempotency:', LEFT(SHA2(CONCAT(
                LENGTH(DATABASE()), ':', DATABASE(),
                LENGTH(p_tenant), ':', p_tenant, LENGTH(p_scope), ':', p_scope, p_key), 256), 52));
            -- The session's own wait, saved once (a later turn finds the
            -- slice's there).
            IF v_old_wait IS NULL THEN
                SET v_old_wait = @@SESSION.innodb_lock_wait_timeout;
            END IF;
            IF v_wait_started IS NULL THEN
                -- In transactional mode the bound counts from the CALL's
                -- start: the whole seconds the first read waited are spent
                -- (see the top).
                SET v_wait_started = COALESCE(v_call_started, SYSDATE(6));
                SET v_left_s = GREATEST(0, p_lock_wait_s - FLOOR(
                    TIMESTAMPDIFF(MICROSECOND, v_wait_started, SYSDATE(6)) / 1000000));
            ELSE
                SET v_left_s = GREATEST(0, FLOOR(
                    p_lock_wait_s - TIMESTAMPDIFF(MICROSECOND, v_wait_started, SYSDATE(6)) / 1000000));
            END IF;
            SET v_got = GET_LOCK(v_lock_name, 0);
            IF v_got = 1 THEN
                SET v_locked = 1;
                SET SESSION innodb_lock_wait_timeout = IF(v_slices = 1, LEAST(1, v_left_s), v_left_s);
            ELSE
                SET v_got = GET_LOCK(v_lock_name, v_left_s);
                IF v_got IS NULL THEN
                    SIGNAL SQLSTATE 'HY000'
                        SET MESSAGE_TEXT = 'idempotency_reserve: GET_LOCK failed';
                END IF;
                IF v_got = 0 THEN
                    SET v_busy = 1;
                    LEAVE decide;
                END IF;
                SET v_locked = 1;
                -- Whatever is left of the wait, in whole seconds (rounded
                -- down); in slices, a second of it at most.
                SET v_left_s = GREATEST(0, FLOOR(
                    p_lock_wait_s - TIMESTAMPDIFF(MICROSECOND, v_wait_started, SYSDATE(6)) / 1000000));
                SET SESSION innodb_lock_wait_timeout = IF(v_slices = 1, LEAST(1, v_left_s), v_left_s);
                -- Another reserver went first: decide again on a fresh read.
                ITERATE decide;
            END IF;
        END IF;

        -- Write, fenced. An UPDATE that waited for the row takes its times
        -- from when it got it (SYSDATE), not from when the statement started;
        -- an INSERT that waited is brought up to date afterwards.
        IF v_decision = 'insert' THEN
            SET v_dup = 0;
            INSERT INTO idempotency_records
                (tenant, scope, `key`, state, fingerprint, owner_token, is_error, result,
                 lease_expires_at, expires_at, created_at, updated_at,
                 attempt, attempt_started_at, recovered)
            VALUES (p_tenant, p_scope, p_key, 'in_progress', p_fingerprint, p_token, 0, NULL,
                    UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000) + p_lease_ms,
                    UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000) + p_ttl_ms,
                    UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000),
                    UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000),
                    1, UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000), 0);
            IF v_timed_out = 1 THEN
                LEAVE decide;
            END IF;
            IF v_dup = 0 THEN
                SET v_inserted = 1;
                -- Since the read; more than a few ms means the insert waited.
                SET v_elapsed_ms = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000) - v_now;
                IF v_elapsed_ms <= 50 THEN
                    SET v_decision = 'acquired', v_attempt_number = 1;
                    LEAVE decide;
                END IF;
                -- The insert waited (on a row another transaction held and
                -- then let go): start the lease from now.
                UPDATE idempotency_records SET
                    lease_expires_at = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000) + p_lease_ms,
                    expires_at = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000) + p_ttl_ms,
                    created_at = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000),
                    updated_at = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000),
                    attempt_started_at = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)
                 WHERE tenant = p_tenant AND scope = p_scope AND `key` = p_key
                   AND state = 'in_progress' AND owner_token = p_token;
                IF v_timed_out = 1 THEN
                    LEAVE decide;
                END IF;
            END IF;
            -- A record is there (or it was ours and needs checking): read it
            -- at its latest and decide again.
            SET v_latest = 1;
        ELSE
            IF v_decision = 'replace' THEN
                UPDATE idempotency_records SET
                    state = 'in_progress', fingerprint = p_fingerprint, owner_token = p_token,
                    is_error = 0, result = NULL,
                    lease_expires_at = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)
                        + FLOOR(TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6)) / 1000) + p_lease_ms,
                    expires_at = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)
                        + FLOOR(TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6)) / 1000) + p_ttl_ms,
                    created_at = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)
                        + FLOOR(TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6)) / 1000),
                    updated_at = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)
                        + FLOOR(TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6)) / 1000),
                    attempt = 1,
                    attempt_started_at = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)
                        + FLOOR(TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6)) / 1000),
                    recovered = 0
                 WHERE tenant = p_tenant AND scope = p_scope AND `key` = p_key
                   AND expires_at + 0 <= v_now AND (state = 'complete' OR lease_expires_at <= v_now)
                   -- In a caller's transaction, an in-progress record: the
                   -- very version its read saw (see the top of 0013).
                   AND (v_in_tx = 0 OR state = 'complete'
                        OR (v_state = 'in_progress' AND owner_token <=> v_token
                            AND lease_expires_at <=> v_lease));
            ELSE
                -- take_over: still the same owner's record, its lease still run out.
                UPDATE idempotency_records SET
                    fingerprint = p_fingerprint, owner_token = p_token,
                    lease_expires_at = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)
                        + FLOOR(TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6)) / 1000) + p_lease_ms,
                    expires_at = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)
                        + FLOOR(TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6)) / 1000) + p_ttl_ms,
                    updated_at = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)
                        + FLOOR(TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6)) / 1000),
                    attempt = attempt + 1,
                    attempt_started_at = UNIX_TIMESTAMP() * 1000 + FLOOR(MICROSECOND(NOW(6)) / 1000)
                        + FLOOR(TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6)) / 1000)
                 WHERE tenant = p_tenant AND scope = p_scope AND `key` = p_key
                   AND state = 'in_progress' AND owner_token = v_token AND lease_expires_at <= v_now
                   -- In a caller's transaction: the very version its read saw
                   -- (see the top of 0013).
                   AND (v_in_tx = 0 OR lease_expires_at = v_lease);
            END IF;
            SET v_rows = ROW_COUNT();
            IF v_timed_out = 1 THEN
                LEAVE decide;
            END IF;
            IF v_rows = 1 THEN
                -- The fence held: the record is the one read in this pass
                -- (same owner token, so the same attempt).
                IF v_decision = 'take_over' THEN
                    SET v_took_over = 1, v_attempt_number = COALESCE(v_rec_attempt, 1) + 1,
                        v_previous_started = COALESCE(v_rec_attempt_started, v_rec_created);
                ELSE
                    SET v_attempt_number = 1;
                END IF;
                SET v_decision = 'acquired';
                LEAVE decide;
            END IF;
            SET v_latest = 1;
        END IF;
    END LOOP decide;
        -- A slice of a row wait ran out (the statement that waited was
        -- rolled back, nothing written, no lock kept) with a second or more
        -- of the wait left, and no failed write of this CALL holds a lock on
        -- the row: let the GET_LOCK go, so a reserver waiting for it takes
        -- its turn in the row wait (where InnoDB sees it), and start again
        -- as a new CALL would: the seconds left of the wait for the read
        -- (under SERIALIZABLE a plain read locks), the 1205 flag cleared,
        -- the passes counted afresh (none of them met a changed record: that
        -- sets v_latest).
        IF v_timed_out = 1 AND v_slices = 1 AND v_locked = 1 AND v_latest = 0
           AND v_inserted = 0 THEN
            SET v_left_s = FLOOR(
                p_lock_wait_s - TIMESTAMPDIFF(MICROSECOND, v_wait_started, SYSDATE(6)) / 1000000);
            IF v_left_s >= 1 THEN
                DO RELEASE_LOCK(v_lock_name);
                SET v_locked = 0, v_timed_out = 0, v_attempt = 0;
                SET SESSION innodb_lock_wait_timeout = GREATEST(1, v_left_s);
                ITERATE slices;
            END IF;
        END IF;
        LEAVE slices;
    END LOOP slices;

    -- Transactional mode: an answer that may leave the transaction holding
    -- a lock on an in-progress record (after a locking read, or on a live
    -- lease, which a SERIALIZABLE read locks whatever the session says)
    -- marks the version it read (see the top of 0014).
    IF v_in_tx = 1 AND v_found = 1 AND v_state = 'in_progress'
       AND v_decision IN ('in_progress', 'mismatch', 'stale_snapshot') THEN
        IF v_latest = 1 OR v_lease > v_now THEN
            IF v_tx_signature IS NULL THEN
                CALL idempotency_tx_signature(v_tx_signature);
            END IF;
            -- Without a signature nothing is marked (see the top).
            IF v_tx_signature IS NOT NULL THEN
                IF @idempotency_tx_locked IS NULL
                   OR SUBSTRING_INDEX(@idempotency_tx_locked, '/', 1) <> v_tx_signature THEN
                    SET @idempotency_tx_locked = CONCAT(v_tx_signature, '/,', v_version, ',');
                ELSEIF @idempotency_tx_locked NOT LIKE '%/*'
                       AND LOCATE(CONCAT(',', v_version, ','), @idempotency_tx_locked) = 0 THEN
                    IF LENGTH(@idempotency_tx_locked) > 200 * 33 THEN
                        SET @idempotency_tx_locked = CONCAT(v_tx_signature, '/*');
                    ELSE
                        SET @idempotency_tx_locked = CONCAT(@idempotency_tx_locked, v_version, ',');
                    END IF;
                END IF;
            END IF;
        END IF;
    END IF;

    IF v_locked = 1 THEN
        DO RELEASE_LOCK(v_lock_name);
        SET v_locked = 0;
    END IF;
    IF v_old_wait IS NOT NULL THEN
        SET SESSION innodb_lock_wait_timeout = v_old_wait;
    END IF;
    IF v_old_autocommit IS NOT NULL THEN
        SET SESSION autocommit = v_old_autocommit;
    END IF;
    IF v_timed_out = 1 AND p_own_tx = 0 AND @@GLOBAL.innodb_rollback_on_timeout = 1 THEN
        -- The server rolled the caller's whole transaction back: say so
        -- rather than let its later statements run outside it.
        SIGNAL SQLSTATE 'HY000' SET MYSQL_ERRNO = 1205,
            MESSAGE_TEXT = 'idempotency_reserve: lock wait timeout; innodb_rollback_on_timeout rolled the transaction back';
    END IF;
    IF v_timed_out = 1 OR v_busy = 1 THEN
        -- Another transaction holds the record (a transactional-mode owner
        -- whose body is running) or another reserver is waiting for it: a
        -- call in progress, its remaining time unknown: at most a second.
        SET v_decision = 'in_progress', v_lease_remaining = LEAST(p_lease_ms, 1000);
    END IF;
    IF v_decision <> 'completed' THEN
        SET v_is_error = 0, v_result = NULL;
    END IF;
    IF v_decision = 'mismatch' THEN
        -- Transactional mode: a mismatch with an in-progress record whose
        -- lease is live tells the lease left too. Under SERIALIZABLE the
        -- read locked the record, and the runtime refuses the transaction
        -- (StaleSnapshot: it must end before the owner can renew), as it
        -- does an answer of in progress (see the top of 0014).
        SET v_lease_remaining = IF(v_in_tx = 1 AND v_state = 'in_progress' AND v_lease > v_now,
                                   v_lease - v_now, NULL);
    ELSEIF v_decision <> 'in_progress' THEN
        SET v_lease_remaining = NULL;
    END IF;
    IF v_decision <> 'acquired' THEN
        SET v_took_over = 0, v_attempt_number = NULL, v_previous_started = NULL;
    END IF;
    SET o_outcome = v_decision, o_took_over = v_took_over, o_is_error = v_is_error,
        o_result = v_result, o_lease_remaining_ms = v_lease_remaining,
        o_attempt_number = v_attempt_number, o_previous_attempt_started_at = v_previous_started;
    IF p_select = 1 THEN
        SELECT v_decision AS outcome, v_took_over AS took_over, v_is_error AS is_error,
               v_result AS result, v_lease_remaining AS lease_remaining_ms,
               v_attempt_number AS attempt_number,
               v_previous_started AS previous_attempt_started_at;
    END IF;
END
