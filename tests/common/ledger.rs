//! What hooks and bodies saw, kept per tenant: each test uses a fresh
//! tenant, so tests running at once in one binary share a ledger without
//! reading each other's entries.

use std::sync::{Mutex, PoisonError};

/// Entries in the order they were recorded, each under its tenant.
pub struct Ledger<T>(Mutex<Vec<(String, T)>>);

impl<T: Clone> Ledger<T> {
    /// An empty ledger (for a `static`).
    pub const fn new() -> Self {
        Ledger(Mutex::new(Vec::new()))
    }

    /// Adds `entry` under `tenant`.
    pub fn record(&self, tenant: &str, entry: T) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((tenant.to_owned(), entry));
    }

    /// The tenant's entries, oldest first.
    pub fn of(&self, tenant: &str) -> Vec<T> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(t, _)| t == tenant)
            .map(|(_, entry)| entry.clone())
            .collect()
    }

    /// Strikes every entry equal to `entry` from the tenant's.
    pub fn forget(&self, tenant: &str, entry: &T)
    where
        T: PartialEq,
    {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(t, e)| t != tenant || e != entry);
    }
}

impl<T: Clone> Default for Ledger<T> {
    fn default() -> Self {
        Self::new()
    }
}
