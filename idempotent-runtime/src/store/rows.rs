//! Row decoding shared by the SQL stores: one function per value the stores
//! hand back, generic over the sqlx row type.
//!
//! Each store selects the same column aliases, with the same types (text,
//! 64-bit integers, booleans, bytes), and decodes them here:
//!
//! * [`snapshot`]: `state, fingerprint, owner_token, is_error, result,
//!   lease_expires_at, expires_at, now_ms, created_at, attempt,
//!   attempt_started_at, recovered` → [`RecordSnapshot`];
//! * [`scope_stats`]: `scope, complete, in_progress, stuck, expired, oldest,
//!   taken_over, recovered, longest_stuck, longest_unpurged` → [`ScopeStats`];
//! * [`answer`]: `state, fingerprint, is_error, result, lease_remaining,
//!   expired` → the [`Reservation`] a plain read of the record answers, if any.

use super::*;
use sqlx::{ColumnIndex, Decode, Row, Type};

/// A value sqlx can read from a column of database `DB`.
pub(crate) trait Column<'r, DB: sqlx::Database>: Decode<'r, DB> + Type<DB> {}
impl<'r, DB: sqlx::Database, T: Decode<'r, DB> + Type<DB>> Column<'r, DB> for T {}

/// A recorded outcome as stored: a missing payload reads as JSON `null`.
pub(crate) fn stored_outcome(is_error: bool, result: Option<Vec<u8>>) -> StoredOutcome {
    StoredOutcome {
        is_error,
        payload: result.unwrap_or_else(|| b"null".to_vec()),
    }
}

/// A stored attempt number; anything out of range reads as the first attempt.
pub(crate) fn attempt_number(stored: i64) -> u32 {
    u32::try_from(stored).unwrap_or(1).max(1)
}

fn state_of(name: &str) -> Result<RecordState, sqlx::Error> {
    RecordState::parse(name)
        .ok_or_else(|| sqlx::Error::Protocol(format!("unknown record state `{name}`")))
}

/// A row of one of the SQL stores, read by the column aliases above.
pub(crate) struct Columns<'r, R>(pub &'r R);

impl<'r, R> Columns<'r, R>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    String: Column<'r, R::Database>,
    i64: Column<'r, R::Database>,
    bool: Column<'r, R::Database>,
    Vec<u8>: Column<'r, R::Database>,
{
    /// Decodes the row a `fetch` found, if any ([`snapshot`](Self::snapshot)).
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn snapshot_if_found(
        row: Option<&'r R>,
    ) -> Result<Option<RecordSnapshot>, sqlx::Error> {
        row.map(|row| Columns(row).snapshot()).transpose()
    }

    /// Decodes a `fetch` row (the aliases are listed in the module docs).
    pub(crate) fn snapshot(&self) -> Result<RecordSnapshot, sqlx::Error> {
        let state = state_of(&self.0.try_get::<String, _>("state")?)?;
        Ok(RecordSnapshot {
            state,
            fingerprint: self.0.try_get("fingerprint")?,
            owner_token: self.0.try_get("owner_token")?,
            outcome: match state {
                RecordState::Complete => Some(stored_outcome(
                    self.0.try_get("is_error")?,
                    self.0.try_get("result")?,
                )),
                RecordState::InProgress => None,
            },
            lease_expires_at_ms: match state {
                RecordState::InProgress => self.0.try_get("lease_expires_at")?,
                RecordState::Complete => None,
            },
            expires_at_ms: self.0.try_get("expires_at")?,
            now_ms: self.0.try_get("now_ms")?,
            created_at_ms: self.0.try_get("created_at")?,
            attempt: attempt_number(self.0.try_get("attempt")?),
            attempt_started_at_ms: self.0.try_get("attempt_started_at")?,
            recovered: self.0.try_get("recovered")?,
        })
    }

    /// Decodes a `scope_stats` row (the aliases are listed in the module docs).
    pub(crate) fn scope_stats(&self) -> Result<ScopeStats, sqlx::Error> {
        let count = |column: &'static str| -> Result<u64, sqlx::Error> {
            Ok(u64::try_from(self.0.try_get::<i64, _>(column)?).unwrap_or(0))
        };
        Ok(ScopeStats {
            scope: self.0.try_get("scope")?,
            complete: count("complete")?,
            in_progress: count("in_progress")?,
            stuck: count("stuck")?,
            expired: count("expired")?,
            oldest_created_at_ms: self.0.try_get("oldest")?,
            taken_over: count("taken_over")?,
            recovered: count("recovered")?,
            longest_stuck_ms: self.0.try_get("longest_stuck")?,
            longest_unpurged_ms: self.0.try_get("longest_unpurged")?,
        })
    }

    /// What a plain read of the record answers to a request with `fingerprint`
    /// (the aliases are listed in the module docs), in the order the reservation
    /// procedures decide: an expired record, or an in-progress one whose lease ran
    /// out, answers nothing (`None`: a write is due); otherwise a mismatch, a
    /// replay or a live lease.
    pub(crate) fn answer(
        &self,
        fingerprint: Option<&str>,
    ) -> Result<Option<Reservation>, sqlx::Error> {
        self.answer_from(fingerprint, ANSWER_COLUMNS)
    }

    /// [`answer`](Self::answer) with the columns found at `columns`: their
    /// aliases, or their positions where the driver does not know the names
    /// (MySQL's prepared `INSERT … RETURNING`).
    pub(crate) fn answer_from<I: ColumnIndex<R> + Copy>(
        &self,
        fingerprint: Option<&str>,
        columns: AnswerColumns<I>,
    ) -> Result<Option<Reservation>, sqlx::Error> {
        if self.0.try_get::<bool, _>(columns.expired)? {
            return Ok(None);
        }
        let stored: Option<String> = self.0.try_get(columns.fingerprint)?;
        if fingerprints_conflict(stored.as_deref(), fingerprint) {
            return Ok(Some(Reservation::FingerprintMismatch));
        }
        if state_of(&self.0.try_get::<String, _>(columns.state)?)? == RecordState::Complete {
            return Ok(Some(Reservation::Completed(stored_outcome(
                self.0.try_get(columns.is_error)?,
                self.0.try_get(columns.result)?,
            ))));
        }
        Ok(
            match self.0.try_get::<Option<i64>, _>(columns.lease_remaining)? {
                Some(ms) if ms > 0 => Some(Reservation::InProgress {
                    lease_remaining: millis_to_duration(ms),
                }),
                _ => None,
            },
        )
    }
}

/// Where [`Columns::answer_from`] finds each column: by alias or by position.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AnswerColumns<I> {
    pub state: I,
    pub fingerprint: I,
    pub is_error: I,
    pub result: I,
    pub lease_remaining: I,
    pub expired: I,
}

/// The aliases [`Columns::answer`] reads.
const ANSWER_COLUMNS: AnswerColumns<&'static str> = AnswerColumns {
    state: "state",
    fingerprint: "fingerprint",
    is_error: "is_error",
    result: "result",
    lease_remaining: "lease_remaining",
    expired: "expired",
};
