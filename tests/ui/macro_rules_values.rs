// Invalid values passed through `macro_rules!` metavariables are refused as if
// written directly, each error spanned at the value where the macro is called.
use idempotent_runtime::{idempotent, Error};

const SCOPE: &str = "rules.charge";

macro_rules! with_literals {
    ($scope:literal, $ttl:literal, $wait:literal, $fp:literal; [$($rest:tt)*] $($f:tt)*) => {
        #[idempotent(scope = $scope, ttl = $ttl, in_progress = wait($wait), fingerprint = $fp,
                     $($rest)*)]
        $($f)*
    };
}

with_literals!("Bad.Scope", "24h", "1s", true; [key = key, tenant = shared]
    async fn bad_scope(key: &str) -> Result<u8, Error> {
        Ok(1)
    }
);

with_literals!("rules.bad_durations", "0s", "soon", "no"; [key = key, tenant = shared]
    async fn bad_durations(key: &str) -> Result<u8, Error> {
        Ok(1)
    }
);

macro_rules! with_exprs {
    ($scope:expr, $tx:expr, $skip:expr, $errors:expr, $krate:expr; [$($rest:tt)*] $($f:tt)*) => {
        #[idempotent(scope = $scope, tx = $tx, skip($skip), errors = $errors, crate = $krate,
                     $($rest)*)]
        $($f)*
    };
}

with_exprs!(SCOPE, conn, nope, record_if("final"), "idempotent_runtime"; [key = key, tenant = shared]
    async fn bad_exprs(key: &str) -> Result<u8, Error> {
        Ok(1)
    }
);

macro_rules! with_path {
    ($in_progress:path; [$($rest:tt)*] $($f:tt)*) => {
        #[idempotent(scope = "rules.bad_path", in_progress = $in_progress, $($rest)*)]
        $($f)*
    };
}

with_path!(queue; [key = key, tenant = shared]
    async fn bad_path(key: &str) -> Result<u8, Error> {
        Ok(1)
    }
);

fn main() {}
