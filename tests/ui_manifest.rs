//! Scope-manifest checks (DESIGN.md rule 18): the attribute's scope must be
//! declared in `idempotent.toml` and not retired; the manifest's `ttl`/`lease`
//! are defaults. The manifest is supplied through `IDEMPOTENT_MANIFEST`.
//!
//! One test function on purpose: the cases run one after another with a
//! different manifest each, and the environment variable is process-wide.
//! Regenerate with `TRYBUILD=overwrite cargo test --test ui_manifest`.

use std::path::Path;

fn with_manifest(manifest: &Path, run: impl FnOnce(&trybuild::TestCases)) {
    std::env::set_var("IDEMPOTENT_MANIFEST", manifest);
    let t = trybuild::TestCases::new();
    run(&t);
    drop(t); // trybuild runs the cases here, while the variable is set
}

#[test]
fn ui_manifest() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ui-manifest");
    with_manifest(&dir.join("idempotent.toml"), |t| {
        t.compile_fail("tests/ui-manifest/*.rs");
        t.pass("tests/ui-manifest/pass/*.rs");
    });
    with_manifest(&dir.join("bad-entries/idempotent.toml"), |t| {
        t.compile_fail("tests/ui-manifest/bad-entries/*.rs");
    });
    with_manifest(&dir.join("broken/idempotent.toml"), |t| {
        t.compile_fail("tests/ui-manifest/broken/*.rs");
    });
    with_manifest(&dir.join("missing/no-such-manifest.toml"), |t| {
        t.compile_fail("tests/ui-manifest/missing/*.rs");
    });
    std::env::remove_var("IDEMPOTENT_MANIFEST");
}
