//! Every compile error `#[idempotent]` can produce, with its message
//! (`tests/ui/*.rs` + `.stderr`), and the scope-manifest checks (DESIGN.md
//! rule 18, `tests/ui-manifest/`): the attribute's scope must be declared in
//! `idempotent.toml` and not retired, and the manifest must be readable and
//! valid. The manifest is supplied through `IDEMPOTENT_MANIFEST`.
//!
//! Only compile errors are checked here. The shapes that must compile are
//! ordinary tests that also run them (`tests/attribute_contract/macro_shapes.rs`,
//! `macro_rules_args.rs`), and the manifest's defaults are checked on code
//! compiled with this package's manifest (`tests/manifest_defaults.rs`): a passing
//! trybuild case costs a full build of its dependencies, a failing one only
//! a check.
//!
//! The cases live with the workspace's cross-crate tests (`tests/ui/`,
//! `tests/ui-manifest/` at the top of the workspace); the driver lives in
//! this small package because trybuild builds its test crate with every
//! dependency of the package the driver belongs to: here that is the runtime
//! without any store driver, serde and tokio, a fraction of the suite
//! package's dependencies (sqlx's drivers, axum, NATS, reqwest, ...).
//! One driver binary for both tests: they share one test crate under
//! `target/tests/trybuild/`. The dependencies are built without debug info
//! (`CARGO_PROFILE_DEV_DEBUG=0` for trybuild's cargo): the cases' messages do
//! not depend on it, and it is much of the build's cost.
//!
//! The environment variable is process-wide, so the two tests hold one lock
//! (under `cargo test` they share a process). nextest runs each in a process
//! of its own, one at a time (they share trybuild's test crate), beside the
//! rest of the suite: see `lower_priority`.
//! Regenerate the expected output with
//! `TRYBUILD=overwrite cargo test -p idempotent-macro-tests --test ui`,
//! then read every changed `.stderr`.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// Where the cases are: `tests/ui` and `tests/ui-manifest` here are links to
/// the workspace's own, so trybuild sees them inside this package and
/// reports `tests/ui/<case>.rs:<line>:<column>` locations.
fn cases() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests")
}

/// Held while a test sets the environment and runs its cases.
fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    lower_priority();
    // Read by the cargo that trybuild starts, not by this process.
    std::env::set_var("CARGO_PROFILE_DEV_DEBUG", "0");
    // CI lints the workspace while building it (clippy-driver as the
    // workspace's rustc wrapper, see .ci/run); the cases are compiled as
    // rustc alone compiles them, so their expected output is rustc's.
    std::env::remove_var("RUSTC_WORKSPACE_WRAPPER");
    std::env::remove_var("CLIPPY_ARGS");
    one_build_of_the_dependencies();
    guard
}

/// The flags trybuild (1.0.122, `src/rustflags.rs` and `src/cargo.rs`) gives
/// rustc when it compiles the cases, `--diagnostic-width=140` included.
const TRYBUILD_CASE_FLAGS: [&str; 6] = [
    "--cfg",
    "trybuild",
    "--verbose",
    "-A",
    "dead_code",
    "--diagnostic-width=140",
];

/// trybuild first checks the test crate's dependencies with its own flags,
/// then checks the cases with `--diagnostic-width=140` added: a change of
/// flags, so cargo checked every dependency a second time, into other files
/// (about a third of this test's compiling, on a cold machine). Flags in
/// `CARGO_ENCODED_RUSTFLAGS` come before the `build.rustflags` trybuild
/// passes, so both of its cargo runs use these, the case flags: the
/// dependencies are checked once, and the cases compile with the flags
/// trybuild gives them (the same messages). Left alone when `RUSTFLAGS` is
/// set (trybuild keeps some of those, e.g. a coverage build's).
fn one_build_of_the_dependencies() {
    if std::env::var_os("RUSTFLAGS").is_some_and(|flags| !flags.is_empty()) {
        return;
    }
    std::env::set_var("CARGO_ENCODED_RUSTFLAGS", TRYBUILD_CASE_FLAGS.join("\x1f"));
}

/// Lowers this thread's scheduling priority to the lowest (`nice` 19); the
/// cargo and rustc processes trybuild starts from it inherit it. Compiling the
/// cases is minutes of work for both cores on a cold machine: at the lowest
/// priority it takes only the time the tests running beside it leave idle
/// (most of them wait on leases, servers and child processes), so the suite
/// need not stop for it, and it never starves a test holding a lease.
fn lower_priority() {
    // SAFETY: `nice` only changes the calling thread's priority; it reads
    // and writes no memory of ours. A refusal (errno) leaves the priority as
    // it was, which costs time, not correctness.
    unsafe {
        libc::nice(19);
    }
}

/// Runs the cases `run` adds with `IDEMPOTENT_MANIFEST` set to `manifest`
/// (unset with `None`).
fn with_manifest(manifest: Option<&Path>, run: impl FnOnce(&trybuild::TestCases)) {
    match manifest {
        Some(manifest) => std::env::set_var("IDEMPOTENT_MANIFEST", manifest),
        None => std::env::remove_var("IDEMPOTENT_MANIFEST"),
    }
    let t = trybuild::TestCases::new();
    run(&t);
    drop(t); // trybuild runs the cases here, while the variable is set
    std::env::remove_var("IDEMPOTENT_MANIFEST");
}

#[test]
fn ui() {
    let _lock = exclusive();
    // These cases must not see a scope manifest.
    with_manifest(None, |t| {
        t.compile_fail(cases().join("ui/*.rs"));
    });
}

/// One test function for every manifest on purpose: the cases run one after
/// another with a different manifest each.
#[test]
fn ui_manifest() {
    let _lock = exclusive();
    let dir = cases().join("ui-manifest");
    // Each folder's cases against its manifest, one folder after another.
    for (folder_cases, manifest) in [
        ("*.rs", "idempotent.toml"),
        ("bad-entries/*.rs", "bad-entries/idempotent.toml"),
        ("broken/*.rs", "broken/idempotent.toml"),
        ("unknown-key/*.rs", "unknown-key/idempotent.toml"),
        ("bad-retired/*.rs", "bad-retired/idempotent.toml"),
        ("unreadable/*.rs", "unreadable/idempotent.toml"),
        ("missing/*.rs", "missing/no-such-manifest.toml"),
    ] {
        with_manifest(Some(&dir.join(manifest)), |t| {
            t.compile_fail(dir.join(folder_cases));
        });
    }
}
