//! Compare what a store holds with what the code (or the manifest) claims.
//!
//! For every scope the report gives the records by state — complete, in
//! progress, *stuck* (in progress with an expired lease: the owner is gone),
//! *expired* (past retention, not purged yet) — and the oldest record. Scopes
//! present in the store that nothing claims are **orphans**: what a rename
//! leaves behind. Declared scopes without records are listed as *unused*
//! (informational).
//!
//! Uncertain outcomes (rule 20) show per scope too: *taken over* counts the
//! records whose expired lease some call took over (the previous attempt may
//! have done the work; a scope where this keeps growing has owners that keep
//! dying or bodies that outlive their lease), *recovered* the complete ones
//! whose answer a `recover` hook gave instead of the body. A scope several
//! functions share on purpose (rule 21, `shared_scope`) lists every claimant.
//!
//! ```
//! use idempotent_runtime::{audit, MemoryStore, registry::Format};
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_runtime::Error> {
//! let store = MemoryStore::new();
//! let report = audit::audit(&store, &audit::KnownScope::from_registry()).await?;
//! println!("{}", report.render(Format::Table));
//! assert_eq!(report.orphans().count(), 0);
//! # Ok(()) }
//! ```

use crate::error::Error;
use crate::registry::Format;
use crate::store::{ScopeStats, Store};
use std::collections::BTreeMap;
use std::time::{Duration, UNIX_EPOCH};

/// How the code (or a manifest) relates to a scope name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Code claims the scope; `by` names the claimants (function paths, or the manifest file).
    Claimed {
        /// Function paths or the manifest that declares the scope.
        by: Vec<String>,
    },
    /// The name was retired (manifest `[retired]`): records under it are leftovers.
    Retired {
        /// The reason given in the manifest.
        reason: Option<String>,
    },
}

/// A scope name the audit should know about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownScope {
    /// The scope string.
    pub scope: String,
    /// Claimed or retired.
    pub claim: Claim,
}

impl KnownScope {
    /// A scope claimed by `by` (a function path, a file name, a service name).
    ///
    /// ```
    /// use idempotent_runtime::audit::KnownScope;
    /// let k = KnownScope::claimed("orders.place", "shop::orders::place");
    /// assert_eq!(k.scope, "orders.place");
    /// ```
    pub fn claimed(scope: impl Into<String>, by: impl Into<String>) -> Self {
        KnownScope {
            scope: scope.into(),
            claim: Claim::Claimed {
                by: vec![by.into()],
            },
        }
    }

    /// A retired scope name, with the reason.
    pub fn retired(scope: impl Into<String>, reason: Option<String>) -> Self {
        KnownScope {
            scope: scope.into(),
            claim: Claim::Retired { reason },
        }
    }

    /// Every scope registered by `#[idempotent]` functions in this binary.
    pub fn from_registry() -> Vec<KnownScope> {
        crate::registry::scopes()
            .into_iter()
            .map(|info| KnownScope::claimed(info.scope, info.function))
            .collect()
    }

    /// The declared scopes of a manifest (claimed by the manifest) and its retired names.
    #[cfg(feature = "manifest")]
    pub fn from_manifest(manifest: &crate::manifest::Manifest) -> Vec<KnownScope> {
        // Named by the file it was read from (`--manifest audit.toml` is not
        // `idempotent.toml`); a manifest parsed from text has no file.
        let source = match manifest.path.file_name() {
            Some(name) if manifest.path.to_str() != Some("<string>") => {
                name.to_string_lossy().into_owned()
            }
            _ => crate::manifest::Manifest::FILE_NAME.to_owned(),
        };
        let declared = manifest
            .scopes
            .keys()
            .map(|s| KnownScope::claimed(s.clone(), source.clone()));
        let retired = manifest
            .retired
            .iter()
            .map(|(s, r)| KnownScope::retired(s.clone(), r.reason.clone()));
        declared.chain(retired).collect()
    }
}

/// Where a scope stands between the code and the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScopeStatus {
    /// Claimed, with or without records.
    Claimed,
    /// Records in the store, claimed by no code: e.g. left behind by a rename.
    Orphan,
    /// Records in the store under a retired name (an orphan with a known reason).
    Retired,
    /// Claimed, no records at all (informational).
    Unused,
}

impl ScopeStatus {
    fn as_str(self) -> &'static str {
        match self {
            ScopeStatus::Claimed => "claimed",
            ScopeStatus::Orphan => "ORPHAN",
            ScopeStatus::Retired => "RETIRED",
            ScopeStatus::Unused => "unused",
        }
    }
}

/// The audit of one scope.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ScopeAudit {
    /// The scope string.
    pub scope: String,
    /// Claimed, orphan, retired or unused.
    pub status: ScopeStatus,
    /// Who claims it (function paths or the manifest); empty for orphans.
    pub claimed_by: Vec<String>,
    /// Why the name was retired (retired scopes only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retired_reason: Option<String>,
    /// Complete records within retention.
    pub complete: u64,
    /// In-progress records with a live lease.
    pub in_progress: u64,
    /// In-progress records whose lease expired: owner crashed or was cut off.
    pub stuck: u64,
    /// Records past retention that no purge has removed yet.
    pub expired: u64,
    /// Creation time of the oldest record, ms since the Unix epoch (store clock).
    pub oldest_created_at_ms: Option<i64>,
    /// The same, as RFC 3339 (UTC, seconds).
    pub oldest_created_at: Option<String>,
    /// Records within retention whose expired lease was taken over at least
    /// once (their attempt number is above 1).
    pub taken_over: u64,
    /// Complete records whose answer a `recover` hook gave (the body did not run).
    pub recovered: u64,
    /// How long ago (ms, store clock) the lease of the record stuck longest
    /// ran out; `None` without stuck records.
    pub longest_stuck_ms: Option<i64>,
    /// How long ago (ms, store clock) the expired record waiting longest for
    /// a purge became purgeable; `None` without expired records.
    pub longest_unpurged_ms: Option<i64>,
}

impl ScopeAudit {
    /// A scope's entry before any of its records are counted.
    fn empty(
        scope: String,
        status: ScopeStatus,
        claimed_by: Vec<String>,
        retired_reason: Option<String>,
    ) -> Self {
        ScopeAudit {
            scope,
            status,
            claimed_by,
            retired_reason,
            complete: 0,
            in_progress: 0,
            stuck: 0,
            expired: 0,
            oldest_created_at_ms: None,
            oldest_created_at: None,
            taken_over: 0,
            recovered: 0,
            longest_stuck_ms: None,
            longest_unpurged_ms: None,
        }
    }

    /// All records of the scope, whatever their state.
    pub fn total(&self) -> u64 {
        self.complete + self.in_progress + self.stuck + self.expired
    }
}

/// The result of [`audit`]: one entry per scope, sorted by scope.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AuditReport {
    /// The store's name (`memory`, `sqlite`, `postgres`, `mysql`).
    pub store: String,
    /// Every scope in the store or claimed, sorted by name.
    pub scopes: Vec<ScopeAudit>,
}

/// Totals over an [`AuditReport`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct AuditSummary {
    /// Scopes listed.
    pub scopes: usize,
    /// Scopes with records that nothing claims and the manifest does not
    /// retire (orphans: a finding).
    pub orphan_scopes: usize,
    /// Retired scopes with records left (expiring after a rename, as the
    /// README's procedure has it: not a finding).
    pub retired_scopes: usize,
    /// Claimed scopes with no records.
    pub unused_scopes: usize,
    /// Records in all scopes.
    pub records: u64,
    /// Stuck in-progress records in all scopes.
    pub stuck: u64,
    /// Expired, unpurged records in all scopes.
    pub expired: u64,
    /// Taken-over records in all scopes.
    pub taken_over: u64,
    /// Recovered records in all scopes.
    pub recovered: u64,
    /// The longest any record has been stuck, in ms (see
    /// [`ScopeAudit::longest_stuck_ms`]); `None` without stuck records.
    pub longest_stuck_ms: Option<i64>,
    /// The longest any expired record has waited for a purge, in ms (see
    /// [`ScopeAudit::longest_unpurged_ms`]); `None` without expired records.
    pub longest_unpurged_ms: Option<i64>,
}

impl AuditReport {
    /// The entry for one scope.
    pub fn scope(&self, scope: &str) -> Option<&ScopeAudit> {
        self.scopes.iter().find(|s| s.scope == scope)
    }

    /// Scopes with records that no code claims and the manifest does not
    /// retire (a finding).
    pub fn orphans(&self) -> impl Iterator<Item = &ScopeAudit> {
        self.scopes
            .iter()
            .filter(|s| s.status == ScopeStatus::Orphan)
    }

    /// Retired scopes with records left (they expire; not a finding).
    pub fn retired(&self) -> impl Iterator<Item = &ScopeAudit> {
        self.scopes
            .iter()
            .filter(|s| s.status == ScopeStatus::Retired)
    }

    /// Claimed scopes without records.
    pub fn unused(&self) -> impl Iterator<Item = &ScopeAudit> {
        self.scopes
            .iter()
            .filter(|s| s.status == ScopeStatus::Unused)
    }

    /// Totals.
    pub fn summary(&self) -> AuditSummary {
        AuditSummary {
            scopes: self.scopes.len(),
            orphan_scopes: self.orphans().count(),
            retired_scopes: self.retired().count(),
            unused_scopes: self.unused().count(),
            records: self.scopes.iter().map(ScopeAudit::total).sum(),
            stuck: self.scopes.iter().map(|s| s.stuck).sum(),
            expired: self.scopes.iter().map(|s| s.expired).sum(),
            taken_over: self.scopes.iter().map(|s| s.taken_over).sum(),
            recovered: self.scopes.iter().map(|s| s.recovered).sum(),
            longest_stuck_ms: self.scopes.iter().filter_map(|s| s.longest_stuck_ms).max(),
            longest_unpurged_ms: self
                .scopes
                .iter()
                .filter_map(|s| s.longest_unpurged_ms)
                .max(),
        }
    }

    /// Whether anything needs attention: orphans, stuck leases or unpurged
    /// records. Records left under a retired name are not (they expire), but
    /// stuck or unpurged ones among them are.
    pub fn has_findings(&self) -> bool {
        self.has_findings_older_than(Duration::ZERO)
    }

    /// [`has_findings`](Self::has_findings) for a scheduled check of a busy
    /// system: orphans count as always, while a stuck lease or an unpurged
    /// record counts only once it has been so for `grace` or longer (by the
    /// store's clock). On a live system some lease has always just run out
    /// (a process restarted mid-call; the next call of its key takes it over)
    /// and some record has always just expired (the purge comes every few
    /// minutes): a `grace` a little longer than the purge's interval and the
    /// time a retry takes to come reports only what is not cleared by itself.
    ///
    /// ```
    /// use idempotent_runtime::{audit, MemoryStore};
    /// use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_runtime::Error> {
    /// let report = audit::audit(&MemoryStore::new(), &[]).await?;
    /// assert!(!report.has_findings_older_than(Duration::from_secs(15 * 60)));
    /// # Ok(()) }
    /// ```
    pub fn has_findings_older_than(&self, grace: Duration) -> bool {
        let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
        // A store that does not say how long (a `Store` of one's own leaving
        // the durations at `None`) has its stuck and unpurged records counted.
        let overdue =
            |count: u64, longest: Option<i64>| count > 0 && longest.is_none_or(|ms| ms >= grace_ms);
        self.orphans().next().is_some()
            || self.scopes.iter().any(|s| {
                overdue(s.stuck, s.longest_stuck_ms) || overdue(s.expired, s.longest_unpurged_ms)
            })
    }

    /// The report as an aligned table followed by a summary line, or as JSON
    /// (`{"store", "scopes": [...], "summary": {...}}`).
    pub fn render(&self, format: Format) -> String {
        match format {
            Format::Json => {
                #[derive(serde::Serialize)]
                struct Out<'a> {
                    store: &'a str,
                    scopes: &'a [ScopeAudit],
                    summary: AuditSummary,
                }
                crate::registry::to_json(&Out {
                    store: &self.store,
                    scopes: &self.scopes,
                    summary: self.summary(),
                })
            }
            Format::Table => {
                let rows: Vec<Vec<String>> = self
                    .scopes
                    .iter()
                    .map(|s| {
                        vec![
                            s.scope.clone(),
                            s.status.as_str().to_owned(),
                            s.complete.to_string(),
                            s.in_progress.to_string(),
                            s.stuck.to_string(),
                            s.expired.to_string(),
                            s.taken_over.to_string(),
                            s.recovered.to_string(),
                            s.oldest_created_at.clone().unwrap_or_else(|| "-".into()),
                            match (&s.retired_reason, s.claimed_by.is_empty()) {
                                (Some(r), _) => format!("retired: {r}"),
                                (None, true) => "-".into(),
                                (None, false) => s.claimed_by.join(", "),
                            },
                        ]
                    })
                    .collect();
                let mut out = crate::table::render(
                    &[
                        "scope",
                        "status",
                        "complete",
                        "in_progress",
                        "stuck",
                        "expired",
                        "taken_over",
                        "recovered",
                        "oldest",
                        "claimed by",
                    ],
                    &rows,
                );
                let sum = self.summary();
                // How long the oldest of them has been so, to the second.
                let longest = |ms: Option<i64>| {
                    ms.map(|ms| {
                        let seconds = u64::try_from(ms / 1000).unwrap_or(0);
                        format!(
                            " (the longest for {})",
                            idempotent_rules::duration::format_duration(Duration::from_secs(
                                seconds
                            ))
                        )
                    })
                    .unwrap_or_default()
                };
                out.push_str(&format!(
                    "\n{} store: {} scope(s), {} record(s); {} orphan scope(s), {} retired scope(s) with records left, {} stuck lease(s){}, {} expired record(s) not purged{}, {} unused scope(s)\n",
                    self.store, sum.scopes, sum.records, sum.orphan_scopes, sum.retired_scopes, sum.stuck, longest(sum.longest_stuck_ms), sum.expired, longest(sum.longest_unpurged_ms), sum.unused_scopes
                ));
                if sum.orphan_scopes > 0 {
                    out.push_str("orphans: records no code claims. If a scope was renamed, restore the old string (records keep working) or retire it in idempotent.toml and let the records expire.\n");
                }
                if sum.expired > 0 {
                    out.push_str(
                        "expired: run `idempotent purge` or a background Purger to delete them.\n",
                    );
                }
                if sum.taken_over > 0 {
                    out.push_str(&format!(
                        "taken over: {} record(s) whose owner's lease ran out were taken over ({} answered by a recover hook); \
                         the previous attempt may have done the work. `idempotent inspect` shows a record's attempt.\n",
                        sum.taken_over, sum.recovered
                    ));
                }
                out
            }
        }
    }
}

/// Audits `store` against `known` (see [`KnownScope::from_registry`] and
/// `KnownScope::from_manifest`). Reads per-scope statistics from the store
/// once; changes nothing.
///
/// ```
/// use idempotent_runtime::{audit::{audit, KnownScope}, MemoryStore};
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_runtime::Error> {
/// let report = audit(&MemoryStore::new(), &[KnownScope::claimed("orders.place", "app")]).await?;
/// assert_eq!(report.unused().count(), 1);
/// # Ok(()) }
/// ```
///
/// The store's answer is waited for at most [`AUDIT_TIMEOUT`]: a stalled
/// server or a lock on the whole records table gives an `Error::Store`
/// saying so, not a wait for ever.
pub async fn audit(store: &dyn Store, known: &[KnownScope]) -> Result<AuditReport, Error> {
    audit_within(store, known, AUDIT_TIMEOUT).await
}

/// [`audit`], waiting at most `bound` (of real time) for the store's counts.
pub async fn audit_within(
    store: &dyn Store,
    known: &[KnownScope],
    bound: Duration,
) -> Result<AuditReport, Error> {
    let stats = crate::store::within_real_time(bound, store.scope_stats())
        .await
        .map_err(|_| {
            crate::error::StoreError::new(
                store.name(),
                "count records per scope",
                format!(
                    "no answer after {bound:?}: the database is stalled, or a lock holds the \
                     records table (a long transaction, LOCK TABLE); try again later"
                ),
            )
        })??;
    Ok(build_report(store.name(), stats, known))
}

/// How long [`audit`] waits for the store's counts (one read of the whole
/// records table, seconds for millions of records).
pub const AUDIT_TIMEOUT: Duration = Duration::from_secs(300);

/// [`audit`] against this binary's registry.
pub async fn audit_registry(store: &dyn Store) -> Result<AuditReport, Error> {
    audit(store, &KnownScope::from_registry()).await
}

fn build_report(store: &str, stats: Vec<ScopeStats>, known: &[KnownScope]) -> AuditReport {
    // Merge the claims per scope: several functions may claim one name (a
    // conflict `registry::validate` reports), and a claim beats a retirement.
    let mut claims: BTreeMap<&str, Claim> = BTreeMap::new();
    for k in known {
        match (claims.get_mut(k.scope.as_str()), &k.claim) {
            (None, c) => {
                claims.insert(&k.scope, c.clone());
            }
            (Some(Claim::Claimed { by }), Claim::Claimed { by: more }) => {
                for b in more {
                    if !by.contains(b) {
                        by.push(b.clone());
                    }
                }
            }
            (Some(existing @ Claim::Retired { .. }), c @ Claim::Claimed { .. }) => {
                *existing = c.clone();
            }
            (Some(_), Claim::Retired { .. }) => {}
        }
    }
    let mut by_scope: BTreeMap<String, ScopeAudit> = BTreeMap::new();
    for s in stats {
        let (status, claimed_by, retired_reason) = match claims.get(s.scope.as_str()) {
            Some(Claim::Claimed { by }) => (ScopeStatus::Claimed, by.clone(), None),
            Some(Claim::Retired { reason }) => (
                ScopeStatus::Retired,
                Vec::new(),
                Some(reason.clone().unwrap_or_else(|| "no reason given".into())),
            ),
            None => (ScopeStatus::Orphan, Vec::new(), None),
        };
        let total = s.complete + s.in_progress + s.stuck + s.expired;
        // A claimed scope whose stats row is empty has no records.
        let status = if total == 0 && status == ScopeStatus::Claimed {
            ScopeStatus::Unused
        } else {
            status
        };
        if total == 0 && status != ScopeStatus::Unused {
            continue;
        }
        let entry = by_scope.entry(s.scope.clone()).or_insert_with(|| {
            ScopeAudit::empty(s.scope.clone(), status, claimed_by, retired_reason)
        });
        entry.complete += s.complete;
        entry.taken_over += s.taken_over;
        entry.recovered += s.recovered;
        entry.in_progress += s.in_progress;
        entry.stuck += s.stuck;
        entry.expired += s.expired;
        entry.oldest_created_at_ms = match (entry.oldest_created_at_ms, s.oldest_created_at_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        entry.oldest_created_at = entry.oldest_created_at_ms.map(rfc3339);
        entry.longest_stuck_ms = entry.longest_stuck_ms.max(s.longest_stuck_ms);
        entry.longest_unpurged_ms = entry.longest_unpurged_ms.max(s.longest_unpurged_ms);
    }
    for (scope, claim) in claims {
        if let Claim::Claimed { by } = claim {
            by_scope.entry(scope.to_owned()).or_insert_with(|| {
                ScopeAudit::empty(scope.to_owned(), ScopeStatus::Unused, by, None)
            });
        }
    }
    AuditReport {
        store: store.to_owned(),
        scopes: by_scope.into_values().collect(),
    }
}

fn rfc3339(ms: i64) -> String {
    timestamp(ms, false)
}

/// `ms` after the Unix epoch as RFC 3339 (UTC), to the second or, with
/// `millis`, the millisecond. A time past the year 9999 (RFC 3339 has four
/// digits for the year; only a corrupt row or a wild database clock holds
/// one) is written as the number of ms, never a panic.
pub(crate) fn timestamp(ms: i64, millis: bool) -> String {
    use std::fmt::Write;
    let at = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    let mut text = String::new();
    let written = if millis {
        write!(text, "{}", humantime::format_rfc3339_millis(at))
    } else {
        write!(text, "{}", humantime::format_rfc3339_seconds(at))
    };
    match written {
        Ok(()) => text,
        Err(_) => format!("{ms} ms after the Unix epoch (past the year 9999)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_past_the_year_9999_is_written_not_a_panic() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339(300_000_000_000_000),
            "300000000000000 ms after the Unix epoch (past the year 9999)"
        );
    }

    fn stats(scope: &str, complete: u64, stuck: u64, expired: u64) -> ScopeStats {
        ScopeStats {
            scope: scope.into(),
            complete,
            in_progress: 0,
            stuck,
            expired,
            oldest_created_at_ms: Some(1_700_000_000_000),
            ..ScopeStats::default()
        }
    }

    /// The scopes a manifest declares are claimed by the file they were read
    /// from: `--manifest audit.toml` said `idempotent.toml`.
    #[cfg(feature = "manifest")]
    #[test]
    fn a_manifests_scopes_are_claimed_by_its_file() {
        use crate::manifest::Manifest;
        let text = "[scopes.\"orders.place\"]\n";
        let claimed_by = |m: &Manifest| match &KnownScope::from_manifest(m)[0].claim {
            Claim::Claimed { by } => by.clone(),
            other => panic!("{other:?}"),
        };
        let named = Manifest::parse_named(text, std::path::Path::new("/etc/app/audit.toml"))
            .expect("manifest");
        assert_eq!(claimed_by(&named), ["audit.toml"]);
        let unnamed = Manifest::parse(text).expect("manifest");
        assert_eq!(claimed_by(&unnamed), [Manifest::FILE_NAME]);
    }

    #[test]
    fn classifies_claimed_orphan_retired_unused() {
        let known = [
            KnownScope::claimed("a.live", "app::live"),
            KnownScope::claimed("a.unused", "app::unused"),
            KnownScope::retired("a.old", Some("renamed to a.live".into())),
            KnownScope::retired("a.gone", None),
        ];
        let r = build_report(
            "memory",
            vec![
                stats("a.live", 3, 1, 2),
                stats("a.old", 1, 0, 0),
                stats("b.lost", 0, 0, 4),
            ],
            &known,
        );
        let names: Vec<_> = r.scopes.iter().map(|s| (&*s.scope, s.status)).collect();
        assert_eq!(
            names,
            [
                ("a.live", ScopeStatus::Claimed),
                ("a.old", ScopeStatus::Retired),
                ("a.unused", ScopeStatus::Unused),
                ("b.lost", ScopeStatus::Orphan),
            ]
        );
        let s = r.summary();
        assert_eq!(
            (s.orphan_scopes, s.retired_scopes, s.unused_scopes),
            (1, 1, 1)
        );
        assert_eq!((s.records, s.stuck, s.expired), (11, 1, 6));
        assert!(r.has_findings());
        let table = r.render(Format::Table);
        assert!(table.contains("ORPHAN") && table.contains("retired: renamed to a.live"));
        assert!(table.contains("2023-11-14T22:13:20Z"), "{table}");
        let json: serde_json::Value = serde_json::from_str(&r.render(Format::Json)).unwrap();
        assert_eq!(json["summary"]["orphan_scopes"], 1);
        assert_eq!(json["summary"]["retired_scopes"], 1);
        assert_eq!(json["scopes"][3]["status"], "orphan");
    }

    /// Records left under a retired name, expiring after a rename as the
    /// README says, are not a finding (`audit --check` stays green); an
    /// orphan, or a stuck or unpurged record among them, is.
    #[test]
    fn records_left_under_a_retired_name_are_not_a_finding() {
        let known = [
            KnownScope::claimed("a.live", "app::live"),
            KnownScope::retired("a.old", Some("renamed to a.live".into())),
        ];
        let report =
            |old: ScopeStats| build_report("memory", vec![stats("a.live", 1, 0, 0), old], &known);
        let expiring = report(stats("a.old", 2, 0, 0));
        assert_eq!(expiring.summary().retired_scopes, 1);
        assert!(!expiring.has_findings());
        assert!(
            report(stats("a.old", 2, 1, 0)).has_findings(),
            "a stuck lease is"
        );
        assert!(
            report(stats("a.old", 2, 0, 1)).has_findings(),
            "an unpurged record is"
        );
        let orphan = build_report("memory", vec![stats("b.lost", 1, 0, 0)], &known);
        assert!(orphan.has_findings());
    }

    #[test]
    fn takeovers_and_recoveries_are_reported_per_scope() {
        let known = [KnownScope::claimed("a.pay", "app::pay")];
        let mut pay = stats("a.pay", 4, 1, 0);
        pay.taken_over = 3;
        pay.recovered = 2;
        let r = build_report("memory", vec![pay, stats("a.other", 1, 0, 0)], &known);
        let entry = r.scope("a.pay").expect("a.pay");
        assert_eq!((entry.taken_over, entry.recovered), (3, 2));
        assert_eq!((r.summary().taken_over, r.summary().recovered), (3, 2));
        let table = r.render(Format::Table);
        let header = table.lines().next().unwrap();
        let row = table.lines().find(|l| l.starts_with("a.pay")).unwrap();
        let col = header.find("taken_over").unwrap();
        assert_eq!(&row[col..col + 1], "3", "{table}");
        assert!(table.contains("3 record(s) whose owner's lease ran out were taken over (2 answered by a recover hook)"), "{table}");
        let json: serde_json::Value = serde_json::from_str(&r.render(Format::Json)).unwrap();
        assert_eq!(json["scopes"][1]["recovered"], 2);
        assert_eq!(json["summary"]["taken_over"], 3);
    }

    /// A scheduled check with a grace: a stuck lease or an unpurged record
    /// is a finding once it has been so for the grace or longer, in any
    /// scope; an orphan always is; a store that does not say how long has
    /// its stuck and unpurged records counted whatever the grace.
    #[test]
    fn findings_older_than_a_grace() {
        let known = [
            KnownScope::claimed("a.pay", "app::pay"),
            KnownScope::claimed("a.ship", "app::ship"),
        ];
        let minute = Duration::from_secs(60);
        let mut pay = stats("a.pay", 1, 1, 2);
        pay.longest_stuck_ms = Some(30_000);
        pay.longest_unpurged_ms = Some(45_000);
        let mut ship = stats("a.ship", 1, 0, 1);
        ship.longest_unpurged_ms = Some(59_999);
        let r = build_report("memory", vec![pay.clone(), ship.clone()], &known);
        assert!(r.has_findings() && r.has_findings_older_than(Duration::from_secs(45)));
        assert!(!r.has_findings_older_than(minute));
        let s = r.summary();
        assert_eq!(
            (s.longest_stuck_ms, s.longest_unpurged_ms),
            (Some(30_000), Some(59_999))
        );
        let table = r.render(Format::Table);
        assert!(
            table.contains("1 stuck lease(s) (the longest for 30s), 3 expired record(s) not purged (the longest for 59s)"),
            "{table}"
        );

        ship.longest_unpurged_ms = Some(60_000);
        let r = build_report("memory", vec![pay.clone(), ship], &known);
        assert!(
            r.has_findings_older_than(minute),
            "one scope past the grace"
        );

        pay.longest_stuck_ms = Some(61_000);
        let r = build_report("memory", vec![pay, stats("a.ship", 1, 0, 0)], &known);
        assert!(
            r.has_findings_older_than(minute),
            "a stuck lease past the grace"
        );

        let orphan = build_report("memory", vec![stats("b.lost", 1, 0, 0)], &known);
        assert!(orphan.has_findings_older_than(Duration::from_secs(86_400)));

        let untimed = build_report("memory", vec![stats("a.pay", 1, 1, 1)], &known);
        assert!(untimed.has_findings_older_than(Duration::from_secs(86_400)));
        let table = untimed.render(Format::Table);
        assert!(
            table.contains("1 stuck lease(s), 1 expired record(s) not purged,"),
            "{table}"
        );

        let clean = build_report("memory", vec![stats("a.pay", 3, 0, 0)], &known);
        assert!(!clean.has_findings() && !clean.has_findings_older_than(Duration::ZERO));
    }

    #[test]
    fn a_claim_wins_over_a_retirement_and_claims_merge() {
        let known = [
            KnownScope::retired("a.b", None),
            KnownScope::claimed("a.b", "one"),
            KnownScope::claimed("a.b", "two"),
        ];
        let r = build_report("memory", vec![stats("a.b", 1, 0, 0)], &known);
        assert_eq!(r.scopes[0].status, ScopeStatus::Claimed);
        assert_eq!(r.scopes[0].claimed_by, ["one", "two"]);
        assert!(!r.has_findings());
    }

    /// A name both declared and retired (a manifest listing it in both, or
    /// the registry claiming a name the manifest retires) is claimed,
    /// whichever comes first; a claimant named twice is listed once.
    #[test]
    fn a_claim_wins_over_a_retirement_that_comes_after_it() {
        let claimed = KnownScope::claimed("a.b", "one");
        let retired = KnownScope::retired("a.b", Some("renamed".into()));
        for known in [
            vec![claimed.clone(), retired.clone()],
            vec![claimed.clone(), retired, claimed],
        ] {
            let r = build_report("memory", vec![stats("a.b", 1, 0, 0)], &known);
            assert_eq!(r.scopes[0].status, ScopeStatus::Claimed, "{known:?}");
            assert_eq!(r.scopes[0].claimed_by, ["one"], "{known:?}");
            assert_eq!(r.scopes[0].retired_reason, None, "{known:?}");
        }
    }

    /// A store's row of a scope without records (a store of one's own may
    /// answer one) is no record: a claimed scope is `unused`, and a scope
    /// nothing claims is not listed (no orphan, no finding).
    #[test]
    fn an_empty_row_is_no_record() {
        let known = [KnownScope::claimed("a.live", "app::live")];
        let r = build_report(
            "memory",
            vec![stats("a.live", 0, 0, 0), stats("b.gone", 0, 0, 0)],
            &known,
        );
        let names: Vec<_> = r.scopes.iter().map(|s| (&*s.scope, s.status)).collect();
        assert_eq!(names, [("a.live", ScopeStatus::Unused)]);
        assert!(!r.has_findings());
    }
}
