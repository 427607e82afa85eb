-- One row per (tenant, scope, key). All times are milliseconds since the Unix
-- epoch, computed on the database's clock by the statements themselves.
CREATE TABLE IF NOT EXISTS idempotency_records (
    tenant           TEXT    NOT NULL,
    scope            TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    state            TEXT    NOT NULL CHECK (state IN ('in_progress', 'complete')),
    -- SHA-256 fingerprint of the arguments (versioned); NULL = not fingerprinted.
    fingerprint      TEXT,
    -- The current owner's token; NULL once complete.
    owner_token      TEXT,
    -- When the lease runs out; NULL once complete.
    lease_expires_at INTEGER,
    -- When the record's retention runs out.
    expires_at       INTEGER NOT NULL,
    created_at       INTEGER NOT NULL,
    completed_at     INTEGER,
    -- How often an expired lease was taken over since the record was created.
    takeover_count   INTEGER NOT NULL DEFAULT 0,
    -- The recorded outcome: 1 = a recorded error (errors = record).
    is_error         INTEGER NOT NULL DEFAULT 0,
    result           BLOB,
    PRIMARY KEY (tenant, scope, key)
);

-- The purge job walks expired records in bounded batches.
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at
    ON idempotency_records (expires_at);
