//! Open a store from a database URL, choosing the backend by its scheme.

use crate::error::Error;
use crate::store::Store;
use std::sync::Arc;

/// Why [`connect_url`] could not open a store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL's scheme names no store this crate has.
    #[error("unsupported database URL scheme `{scheme}`; use sqlite:PATH, postgres://..., postgresql://..., mysql://... or mariadb://...")]
    UnsupportedScheme {
        /// The scheme found (everything before the first `:`), or the whole URL if it has none.
        scheme: String,
    },
    /// The store for this scheme exists but was compiled out.
    #[error("the {store} store is not compiled in; enable the `{feature}` feature of idempotent-runtime")]
    FeatureDisabled {
        /// The store's name.
        store: &'static str,
        /// The Cargo feature that enables it.
        feature: &'static str,
    },
    /// The store could not connect or migrate.
    #[error(transparent)]
    Store(#[from] Error),
}

/// Opens the store a URL names: `sqlite:` → [`SqliteStore`](crate::SqliteStore),
/// `postgres://` / `postgresql://` → [`PgStore`](crate::PgStore),
/// `mysql://` / `mariadb://` → [`MySqlStore`](crate::MySqlStore). The
/// schema migrations apply themselves, as with each store's own `connect`.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_runtime::connect::ConnectError> {
/// let store = idempotent_runtime::connect_url("sqlite:idempotency.db?mode=rwc").await?;
/// println!("opened the {} store", store.name());
/// # Ok(()) }
/// ```
pub async fn connect_url(url: &str) -> Result<Arc<dyn Store>, ConnectError> {
    let url = &*with_lowercase_scheme(url);
    let scheme = scheme_of(url);
    match scheme.as_str() {
        "sqlite" => connect_sqlite(url).await,
        "postgres" | "postgresql" => connect_postgres(url).await,
        "mysql" | "mariadb" => connect_mysql(url).await,
        _ => Err(ConnectError::UnsupportedScheme { scheme }),
    }
}

/// `url` with its scheme in lowercase (`SQLITE:/x.db` → `sqlite:/x.db`):
/// schemes are case-insensitive, but sqlx reads `SQLITE:` as part of a
/// file's name.
pub(crate) fn with_lowercase_scheme(url: &str) -> std::borrow::Cow<'_, str> {
    match url.split_once(':') {
        Some((scheme, rest)) if scheme.bytes().any(|b| b.is_ascii_uppercase()) => {
            format!("{}:{rest}", scheme.to_ascii_lowercase()).into()
        }
        _ => url.into(),
    }
}

/// A URL's scheme, lowercase (`sqlite`, `postgres`, `mysql`, ...).
pub(crate) fn scheme_of(url: &str) -> String {
    url.split_once(':')
        .map_or(url, |(scheme, _)| scheme)
        .to_ascii_lowercase()
}

/// A `mysql://` or `mariadb://` URL as sqlx takes it (`mysql://`): MariaDB
/// speaks the same protocol.
#[cfg(feature = "mysql")]
pub(crate) fn mysql_url(url: &str) -> std::borrow::Cow<'_, str> {
    match url.get(..10) {
        Some(p) if p.eq_ignore_ascii_case("mariadb://") => format!("mysql://{}", &url[10..]).into(),
        _ => url.into(),
    }
}

/// Defines each `$name`, which opens the store `$open` builds from the URL
/// when the `$feature` feature is compiled in, and otherwise says that the
/// store (`$store`) is not ([`ConnectError::FeatureDisabled`]).
macro_rules! connectors {
    ($($name:ident($feature:literal, $store:literal) = |$url:ident| $open:expr;)*) => {$(
        #[cfg(feature = $feature)]
        async fn $name($url: &str) -> Result<Arc<dyn Store>, ConnectError> {
            Ok(Arc::new($open.await?))
        }
        #[cfg(not(feature = $feature))]
        async fn $name(_: &str) -> Result<Arc<dyn Store>, ConnectError> {
            Err(ConnectError::FeatureDisabled {
                store: $store,
                feature: $feature,
            })
        }
    )*};
}

connectors! {
    connect_sqlite("sqlite", "SQLite") = |url| crate::SqliteStore::connect(url);
    connect_postgres("postgres", "PostgreSQL") = |url| crate::PgStore::connect(url);
    connect_mysql("mysql", "MySQL") = |url| crate::MySqlStore::connect(&mysql_url(url));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `SQLITE:/x.db` names the file `/x.db`, as `sqlite:/x.db` does.
    #[test]
    fn a_schemes_case_does_not_count() {
        assert_eq!(
            with_lowercase_scheme("SQLITE:/tmp/x.db"),
            "sqlite:/tmp/x.db"
        );
        assert_eq!(
            with_lowercase_scheme("Postgres://u:P@h/DB"),
            "postgres://u:P@h/DB"
        );
        assert_eq!(with_lowercase_scheme("sqlite:/A.db"), "sqlite:/A.db");
    }

    #[tokio::test]
    async fn unknown_schemes_are_refused_with_the_list() {
        let e = match connect_url("redis://localhost").await {
            Err(e) => e,
            Ok(_) => panic!("redis is not a store"),
        };
        assert!(matches!(&e, ConnectError::UnsupportedScheme { scheme } if scheme == "redis"));
        assert!(e.to_string().contains("postgres://"));
    }
}
