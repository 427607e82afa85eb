-- A random id made once for the records of this file, read by the store when
-- it opens and by transactional mode when it needs it.
--
-- A process holds an answer it could not record yet (a full disk, a file
-- locked past the busy timeout) and records it when one of its own calls
-- takes the record over, instead of running the body again. Two files in one
-- process (one per customer, an old and a new one) may hold a record of the
-- same tenant, scope and key: the answer held for one is not the answer of
-- the other's record, whose takeover asks its `recover` hook or runs the
-- body. The id tells them apart. A copy of the file keeps it. Run again (its
-- history row deleted), it keeps the id there is.
CREATE TABLE IF NOT EXISTS idempotency_database (
    only_row INTEGER NOT NULL DEFAULT 1 PRIMARY KEY CHECK (only_row = 1),
    id       TEXT    NOT NULL
);
INSERT OR IGNORE INTO idempotency_database (id) VALUES (lower(hex(randomblob(16))));
