//! Every compile error `#[idempotent]` can produce, with its message
//! (`tests/ui/*.rs` + `.stderr`), and the shapes that must compile
//! (`tests/ui/pass/*.rs`). Regenerate the expected output with
//! `TRYBUILD=overwrite cargo test --test ui`, then read every changed `.stderr`.
//!
//! Scope-manifest errors live in `tests/ui_manifest.rs`.

#[test]
fn ui() {
    // These cases must not see a scope manifest.
    std::env::remove_var("IDEMPOTENT_MANIFEST");
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
    t.pass("tests/ui/pass/*.rs");
}
