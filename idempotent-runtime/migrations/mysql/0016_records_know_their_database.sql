-- A random id made once for the records of this database, read by the store
-- when it opens and by transactional mode when it needs it.
--
-- A process holds an answer it could not record yet (an outage, a failover)
-- and records it when one of its own calls takes the record over, instead of
-- running the body again. Two databases of one kind in one process (two
-- regions, an old and a new database while moving between them) may hold a
-- record of the same tenant, scope and key: the answer held for one is not
-- the answer of the other's record, whose takeover asks its `recover` hook or
-- runs the body. The id tells them apart. It is data, so it follows the
-- records to a replica, through a failover and into a restored backup.
-- Run again (its history row deleted, as after a restore without the
-- procedures), it keeps the id there is.
-- Statements are separated by lines reading `-- @@statement`.
CREATE TABLE IF NOT EXISTS idempotency_database (
    only_row TINYINT     NOT NULL DEFAULT 1 PRIMARY KEY CHECK (only_row = 1),
    id       VARCHAR(64) NOT NULL
) ENGINE = InnoDB
-- @@statement
INSERT IGNORE INTO idempotency_database (id) VALUES (UUID())
