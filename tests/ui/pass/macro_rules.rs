// Arguments through `macro_rules!` metavariables compile and behave as if
// written directly: `$x:literal`, `$x:expr`, `$x:ident`, `$x:path`, `$x:ty`,
// and a whole attribute from `$($args:tt)*`.
use idempotent_runtime::{idempotent, with_outcome, Error, MemoryStore, Outcome};

macro_rules! endpoint {
    ($scope:literal, $key:expr, $tenant:expr, $store:ident, $skip:ident, $ttl:literal,
     $in_progress:expr, $errors:path; fn $name:ident($($params:tt)*) -> $ret:ty $body:block) => {
        #[idempotent(scope = $scope, key = $key, tenant = $tenant, store = $store,
                     skip($skip), ttl = $ttl, in_progress = $in_progress, errors = $errors)]
        pub async fn $name($($params)*) -> $ret $body
    };
}

endpoint!("pass.macro_rules", key, tenant, store, trace, "1h", wait("2s"), release;
    fn charge(store: &MemoryStore, tenant: &str, key: &str, amount: u64, trace: u64)
        -> Result<u64, Error> {
        let _ = trace;
        Ok(amount * 2)
    }
);

macro_rules! attribute {
    ([$($args:tt)*] $item:item) => {
        #[idempotent($($args)*)]
        $item
    };
}

attribute!([scope = "pass.macro_rules_tt", key = key, tenant = shared, store = store]
    pub async fn refund(store: &MemoryStore, key: &str) -> Result<u8, Error> {
        Ok(7)
    }
);

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = MemoryStore::new();
    assert_eq!(charge(&store, "t", "k", 2, 1).await.unwrap(), 4);
    let (v, o) = with_outcome(charge(&store, "t", "k", 2, 99)).await;
    assert_eq!((v.unwrap(), o), (4, Some(Outcome::Replayed)));
    assert!(matches!(
        charge(&store, "t", "k", 3, 1).await,
        Err(Error::FingerprintMismatch(_))
    ));
    assert_eq!(refund(&store, "k").await.unwrap(), 7);
    let (_, o) = with_outcome(refund(&store, "k")).await;
    assert_eq!(o, Some(Outcome::Replayed));
}
