//! Who a record belongs to: (tenant, scope, key).

use crate::error::{Error, KeyProblem};
use sha2::{Digest, Sha256};

/// The longest key (and tenant) accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 255;

/// The tenant stored for `tenant = shared`.
///
/// Real tenants must be non-empty, so the shared namespace can never collide
/// with a tenant's.
pub const SHARED_TENANT: &str = "";

fn check(value: &str) -> Result<(), KeyProblem> {
    if value.is_empty() {
        return Err(KeyProblem::Empty);
    }
    if value.len() > MAX_KEY_BYTES {
        return Err(KeyProblem::TooLong {
            len: value.len(),
            limit: MAX_KEY_BYTES,
        });
    }
    if let Some((position, c)) = value.char_indices().find(|(_, c)| c.is_control()) {
        return Err(KeyProblem::ControlCharacter {
            position,
            code: c as u32,
        });
    }
    Ok(())
}

/// Checks a client-supplied idempotency key: 1–255 bytes, no control characters.
///
/// ```
/// use idempotent_runtime::{validate_key, Error};
/// assert!(validate_key("7f8c0a4e-checkout").is_ok());
/// assert!(matches!(validate_key(""), Err(Error::InvalidKey(_))));
/// assert!(matches!(validate_key("a\nb"), Err(Error::InvalidKey(_))));
/// ```
pub fn validate_key(key: &str) -> Result<(), Error> {
    check(key).map_err(Error::InvalidKey)
}

/// Checks a tenant value: 1–255 bytes, no control characters.
pub fn validate_tenant(tenant: &str) -> Result<(), Error> {
    check(tenant).map_err(Error::InvalidTenant)
}

/// Rule 1: identities differ when their scopes do. A store keeps scopes of
/// up to [`MAX_SCOPE_BYTES`](idempotent_rules::scope::MAX_SCOPE_BYTES) bytes
/// apart (MariaDB outside strict mode cut longer ones, and two such scopes
/// shared one record); the format itself is the attribute's to check.
fn validate_scope_length(scope: &str) -> Result<(), Error> {
    let limit = idempotent_rules::scope::MAX_SCOPE_BYTES;
    if scope.len() > limit {
        return Err(Error::ScopeTooLong {
            len: scope.len(),
            limit,
        });
    }
    Ok(())
}

/// The identity of a record. Two calls share a record only when all three parts are equal.
///
/// Its `Debug` shows the tenant, the scope and [`key_digest`](Self::key_digest),
/// never the raw key (rule 2: an identity in a log line or a panic message
/// does not leak it).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    /// Whose key this is; [`SHARED_TENANT`] for `tenant = shared`.
    pub(crate) tenant: String,
    /// The unit of work, e.g. `payments.charge`.
    pub(crate) scope: String,
    /// The client-supplied key.
    pub(crate) key: String,
}

impl Identity {
    /// Builds an identity after validating the tenant and key.
    ///
    /// ```
    /// use idempotent_runtime::Identity;
    /// let id = Identity::new("acct_1", "payments.charge", "k-1").unwrap();
    /// assert_eq!(id.key_digest().len(), 16);
    /// ```
    pub fn new(
        tenant: impl Into<String>,
        scope: impl Into<String>,
        key: impl Into<String>,
    ) -> Result<Self, Error> {
        let (tenant, scope, key) = (tenant.into(), scope.into(), key.into());
        validate_key(&key)?;
        validate_tenant(&tenant)?;
        validate_scope_length(&scope)?;
        Ok(Identity { tenant, scope, key })
    }

    /// Builds an identity in the shared namespace (`tenant = shared`).
    pub fn shared(scope: impl Into<String>, key: impl Into<String>) -> Result<Self, Error> {
        let (scope, key) = (scope.into(), key.into());
        validate_key(&key)?;
        validate_scope_length(&scope)?;
        Ok(Identity {
            tenant: SHARED_TENANT.to_owned(),
            scope,
            key,
        })
    }

    /// Whose key this is; [`SHARED_TENANT`] for `tenant = shared`.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The unit of work, e.g. `payments.charge`.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The client-supplied key. Never log it: use
    /// [`key_digest`](Self::key_digest).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// A short digest of the whole identity, safe to log: 16 hex characters of SHA-256.
    pub fn key_digest(&self) -> String {
        short_digest(&[&self.tenant, &self.scope, &self.key])
    }

    /// [`key_digest`](Self::key_digest), computed only when it is displayed:
    /// for log fields (`key = %identity.log_digest()`) that are usually off.
    pub(crate) fn log_digest(&self) -> LogDigest<'_> {
        LogDigest(self)
    }

    /// The context carried by errors about this record (scope and digest, never the raw key).
    pub fn context(&self) -> crate::error::RecordContext {
        crate::error::RecordContext {
            scope: self.scope.clone(),
            key_digest: self.key_digest(),
        }
    }
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("tenant", &self.tenant)
            .field("scope", &self.scope)
            .field("key_digest", &self.key_digest())
            .finish()
    }
}

/// 16 hex characters of SHA-256 over `parts`, each prefixed with its length
/// (so `("ab", "c")` and `("a", "bc")` differ): what logs and `Debug` show
/// in place of a raw key.
pub(crate) fn short_digest(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for part in parts {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(&h.finalize()[..8])
}

/// An identity's [`Identity::key_digest`], computed when displayed.
pub(crate) struct LogDigest<'a>(&'a Identity);

impl std::fmt::Display for LogDigest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.key_digest())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule 2: `Debug` (what `?identity` in a log line, `dbg!` or a panic
    /// message prints) shows the digest, never the raw key.
    #[test]
    fn debug_shows_the_digest_not_the_key() {
        let id = Identity::new("tenant-a", "payments.charge", "SECRET-KEY-4711").expect("identity");
        let shown = format!("{id:?} {id:#?}");
        assert!(!shown.contains("SECRET"), "{shown}");
        assert!(shown.contains(&id.key_digest()), "{shown}");
        assert!(
            shown.contains("tenant-a") && shown.contains("payments.charge"),
            "{shown}"
        );
    }

    /// Rule 1: a scope longer than any store keeps apart is refused, so two
    /// such scopes can never be cut to one (MariaDB outside strict mode gave
    /// two 266-byte scopes one record).
    #[test]
    fn a_scope_longer_than_the_limit_is_refused() {
        let limit = idempotent_rules::scope::MAX_SCOPE_BYTES;
        let longest = "a".repeat(limit);
        assert!(Identity::new("t", longest.as_str(), "k").is_ok());
        assert!(Identity::shared(longest.as_str(), "k").is_ok());
        let too_long = format!("{longest}.one");
        for refused in [
            Identity::new("t", too_long.as_str(), "k"),
            Identity::shared(too_long.as_str(), "k"),
        ] {
            match refused {
                Err(e @ Error::ScopeTooLong { len, limit: l }) => {
                    assert_eq!((len, l), (limit + 4, limit));
                    assert!(e.to_string().contains("shorter"), "{e}");
                }
                other => panic!("expected ScopeTooLong, got {other:?}"),
            }
        }
    }

    #[test]
    fn key_limits() {
        assert!(validate_key(&"a".repeat(255)).is_ok());
        assert!(matches!(
            validate_key(&"a".repeat(256)),
            Err(Error::InvalidKey(KeyProblem::TooLong { len: 256, .. }))
        ));
        assert!(matches!(
            validate_key(""),
            Err(Error::InvalidKey(KeyProblem::Empty))
        ));
        assert!(matches!(
            validate_key("ab\0"),
            Err(Error::InvalidKey(KeyProblem::ControlCharacter {
                position: 2,
                code: 0
            }))
        ));
        assert!(validate_key("ключ-🔑-'%_\\").is_ok());
    }

    #[test]
    fn digest_separates_parts() {
        let a = Identity::new("ab", "s", "c").unwrap();
        let b = Identity::new("a", "s", "bc").unwrap();
        assert_ne!(a.key_digest(), b.key_digest());
        let secret = Identity::new("t", "s", "sk_live_4242").unwrap();
        let d = secret.key_digest();
        assert_eq!(d.len(), 16);
        assert!(d.chars().all(|c| c.is_ascii_hexdigit()));
        assert!(!d.contains("4242") && !format!("{:?}", secret.context()).contains("sk_live"));
    }
}
