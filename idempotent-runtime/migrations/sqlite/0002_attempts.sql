-- Uncertain outcomes (DESIGN.md rule 20). The attempt number of a record is
-- takeover_count + 1 (0001 already counts takeovers); these columns add when
-- attempts started and whether a recover hook answered:
--
-- * attempt_started_at          when the current attempt took the record (ms,
--                               SQLite's clock). NULL on rows written before
--                               this migration: readers fall back to created_at.
-- * previous_attempt_started_at when the attempt that the current one took
--                               over had started; NULL unless taken over. (The
--                               reservation's upsert can only return the row as
--                               it is after the update, so the takeover keeps it.)
-- * recovered                   1 when the recorded result came from a `recover`
--                               hook, not from the body (counted by audits).
ALTER TABLE idempotency_records ADD COLUMN attempt_started_at INTEGER;
ALTER TABLE idempotency_records ADD COLUMN previous_attempt_started_at INTEGER;
ALTER TABLE idempotency_records ADD COLUMN recovered INTEGER NOT NULL DEFAULT 0;
