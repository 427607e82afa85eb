//! The macro's validation entry point, [`validate`], on every argument and
//! combination, and on the shared verdict table (`rules/tests/verdicts.toml`)
//! that the runtime's CLI test reads too.

use super::*;
use crate::attr::path_text;
use quote::quote;

fn check_err(attr: TokenStream, func: TokenStream) -> String {
    match check(attr, func) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

fn check(attr: TokenStream, func: TokenStream) -> Result<Spec, String> {
    check_in(attr, func, &Env::none())
}

fn check_in(attr: TokenStream, func: TokenStream, env: &Env) -> Result<Spec, String> {
    let func: MaybeItemFn = syn::parse2(func).map_err(|e| e.to_string())?;
    validate(attr, Span::call_site(), &func, env).map_err(|e| {
        e.into_iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    })
}

fn charge() -> TokenStream {
    quote!(
        async fn charge(account: &Account, key: &str, req: &Req, note: String) -> Result<u8, E> {
            todo!()
        }
    )
}

/// The plainest function the attribute takes: `async fn f(key: &str) -> Result<u8, E>`.
fn plain_fn() -> TokenStream {
    async_fn(quote!(key: &str))
}

/// `async fn f(<params>) -> Result<u8, E>`: the function most cases annotate.
fn async_fn(params: TokenStream) -> TokenStream {
    quote!(
        async fn f(#params) -> Result<u8, E> {
            todo!()
        }
    )
}

/// The arguments every attribute needs, `scope = "a", key = key, tenant =
/// shared`, then `more`.
fn args(more: TokenStream) -> TokenStream {
    quote!(scope = "a", key = key, tenant = shared, #more)
}

/// Asserts that the reported errors `err` say each of `expected`.
fn assert_reports(err: &str, expected: &[&str]) {
    for expected in expected {
        assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
    }
}

fn names(spec: &Spec) -> Vec<String> {
    spec.fingerprinted
        .iter()
        .map(|f| f.name.to_string())
        .collect()
}

#[test]
fn parameters_named_directly_are_not_fingerprinted() {
    let spec = check(
        quote!(scope = "payments.charge", key = key, tenant = account.id),
        charge(),
    )
    .unwrap();
    assert_eq!(names(&spec), ["account", "req", "note"]);
    let spec = check(
        quote!(
            scope = "payments.charge",
            key = key,
            tenant = account,
            skip(note)
        ),
        charge(),
    )
    .unwrap();
    assert_eq!(names(&spec), ["req"]);
    assert_eq!((spec.ttl, spec.lease), (DEFAULT_TTL, DEFAULT_LEASE));
}

#[test]
fn every_mistake_is_reported() {
    let err = check_err(
        quote!(
            scope = "pay..x",
            kye = key,
            skip(nope),
            ttl = "0s",
            lease = "soon",
            errors = maybe,
            scope = "a"
        ),
        quote!(
            fn charge(key: &str) -> u8 {
                1
            }
        ),
    );
    assert_reports(
        &err,
        &[
            "async fn",
            "must return `Result",
            "two dots in a row",
            "unknown argument `kye`; did you mean `key`?",
            "no parameter `nope`",
            "`ttl` must be longer than zero",
            "`lease` is not a duration",
            "`errors` is `release`",
            "`scope` is given more than once",
            "missing `key`",
            "missing `tenant`",
        ],
    );
}

#[test]
fn combinations_are_checked() {
    for (more, func, expected) in [
        (
            quote!(tx = conn, store = s),
            async_fn(quote!(conn: &mut C, s: &S, key: &str)),
            "cannot be used together",
        ),
        (
            quote!(fingerprint = false, skip(s)),
            async_fn(quote!(s: &S, key: &str)),
            "no effect",
        ),
        (
            quote!(tx = nothere),
            plain_fn(),
            "`tx` must name a parameter",
        ),
    ] {
        let err = check_err(args(more), func);
        assert!(err.contains(expected), "{err}");
    }
}

#[test]
fn only_bare_shared_opts_out() {
    let f = async_fn(quote!(shared: &str, key: &str, n: u8));
    // The bare word with a parameter called `shared` means two things: refused.
    let err = check_err(quote!(scope = "a", key = key, tenant = shared), f.clone());
    assert!(err.contains("write `tenant = (shared)`"), "{err}");
    let spec = check(
        quote!(scope = "a", key = key, tenant = shared),
        async_fn(quote!(key: &str, n: u8)),
    )
    .unwrap();
    assert!(matches!(spec.tenant, Tenant::Shared(_)));
    for tenant in [
        quote!((shared)),
        quote!((shared)),
        quote!(shared.to_owned()),
    ] {
        let spec = check(quote!(scope = "a", key = key, tenant = #tenant), f.clone()).unwrap();
        assert!(matches!(spec.tenant, Tenant::Expr(_)), "{tenant}");
    }
    // `(shared)` names the parameter directly: left out of the fingerprint.
    let spec = check(quote!(scope = "a", key = key, tenant = (shared)), f).unwrap();
    assert_eq!(names(&spec), ["n"]);
}

/// What `macro_rules!` hands over for `$x:literal`, `$x:expr`, `$x:path`.
fn invisible(tokens: TokenStream) -> TokenStream {
    let group = proc_macro2::Group::new(proc_macro2::Delimiter::None, tokens);
    quote!(#group)
}

#[test]
fn metavariable_groups_are_looked_through() {
    let f = async_fn(quote!(conn: &mut C, tenant: &str, key: &str, note: &str, n: u8));
    let scope = invisible(quote!("a.b"));
    // A metavariable handed on to another macro: a group in a group.
    let key = invisible(invisible(quote!(key)));
    let tenant = invisible(quote!(tenant));
    let tx = invisible(quote!(conn));
    let ttl = invisible(quote!("1h"));
    let lease = invisible(quote!("2s"));
    let wait = invisible(quote!("3s"));
    let fp = invisible(quote!(true));
    let pred = invisible(quote!(E::is_final));
    let krate = invisible(quote!(::rt));
    let note = invisible(quote!(note));
    let spec = check(
        quote!(scope = #scope, key = #key, tenant = #tenant, tx = #tx, ttl = #ttl,
               lease = #lease, in_progress = wait(#wait), fingerprint = #fp,
               errors = record_if(#pred), crate = #krate, skip(#note)),
        f.clone(),
    )
    .unwrap();
    assert_eq!(spec.scope.value(), "a.b");
    assert!(matches!(spec.tenant, Tenant::Expr(_)));
    assert_eq!(
        spec.tx.as_ref().map(|t| t.to_string()).as_deref(),
        Some("conn")
    );
    assert_eq!(spec.ttl, Duration::from_secs(3600));
    assert_eq!(spec.lease, Duration::from_secs(2));
    assert!(matches!(spec.in_progress, InProgress::Wait(d) if d == Duration::from_secs(3)));
    assert!(spec.fingerprint);
    assert!(matches!(&spec.errors, Errors::RecordIf(p) if path_text(p) == "E::is_final"));
    assert_eq!(spec.krate.to_string(), ":: rt");
    // key, tenant and tx are named directly; note is skipped.
    assert_eq!(names(&spec), ["n"]);

    // Whole values in a group: `in_progress = $p`, `errors = $e`.
    let shared = invisible(quote!(shared));
    let reject = invisible(quote!(reject));
    let record = invisible(quote!(record));
    let off = invisible(quote!(false));
    let spec = check(
        quote!(scope = "a", key = key, tenant = #shared, in_progress = #reject,
               errors = #record, fingerprint = #off),
        f.clone(),
    )
    .unwrap();
    assert!(
        matches!(spec.tenant, Tenant::Shared(_)),
        "`$t:expr` given `shared`"
    );
    assert!(matches!(spec.in_progress, InProgress::Reject));
    assert!(matches!(spec.errors, Errors::Record));
    assert!(!spec.fingerprint);
    let wait = invisible(quote!(wait("4s")));
    let record_if = invisible(quote!(record_if(E::is_final)));
    let spec = check(
        quote!(scope = "a", key = key, tenant = tenant, in_progress = #wait,
               errors = #record_if),
        f.clone(),
    )
    .unwrap();
    assert!(matches!(spec.in_progress, InProgress::Wait(d) if d == Duration::from_secs(4)));
    assert!(matches!(spec.errors, Errors::RecordIf(_)));

    // `(shared)` in a group is still the parameter, not the opt-out.
    let paren = invisible(quote!((shared)));
    let spec = check(quote!(scope = "a", key = key, tenant = #paren), f.clone()).unwrap();
    assert!(matches!(spec.tenant, Tenant::Expr(_)));

    // A bad value in a group is checked like one written directly.
    let bad = invisible(quote!("Bad.Scope"));
    let zero = invisible(quote!("0s"));
    let no = invisible(quote!("no"));
    let nothere = invisible(quote!(nothere));
    let err = check_err(
        quote!(scope = #bad, key = key, tenant = tenant, ttl = #zero, fingerprint = #no,
               tx = #nothere),
        f,
    );
    assert_reports(
        &err,
        &[
            "uppercase",
            "`ttl` must be longer than zero",
            "`fingerprint` is `true` or `false`",
            "`tx` must name a parameter",
        ],
    );
}

#[test]
fn patterns_need_a_name_unless_fingerprint_is_off() {
    let f = quote!(
        async fn f(key: &str, (a, b): (u8, u8)) -> io::Result<u8> {
            todo!()
        }
    );
    let err = check_err(quote!(scope = "a", key = key, tenant = shared), f.clone());
    assert!(err.contains("is a pattern"), "{err}");
    let spec = check(
        quote!(scope = "a", key = key, tenant = shared, fingerprint = false),
        f,
    )
    .unwrap();
    assert!(!spec.fingerprint && spec.fingerprinted.is_empty());
}

#[test]
fn recover_and_shared_scope() {
    let takes_self = async_fn(quote!(&self, key: &str));
    let spec = check(
        args(quote!(recover = Self::charge_happened, shared_scope)),
        takes_self.clone(),
    )
    .unwrap();
    assert!(spec.shared_scope);
    assert_eq!(
        spec.recover
            .as_ref()
            .map(crate::attr::Recover::text)
            .as_deref(),
        Some("Self::charge_happened")
    );
    // A method of the same value, on a method taking `&self`.
    let method = check(args(quote!(recover = self.charge_happened)), takes_self).unwrap();
    assert_eq!(
        method
            .recover
            .as_ref()
            .map(crate::attr::Recover::text)
            .as_deref(),
        Some("self.charge_happened")
    );
    let spec = check(quote!(scope = "a", key = key, tenant = shared), plain_fn()).unwrap();
    assert!(!spec.shared_scope && spec.recover.is_none());
    let err = check_err(
        args(quote!(recover = 1 + 2, shared_scope = yes)),
        plain_fn(),
    );
    assert_reports(
        &err,
        &[
            "`recover` takes the path of an `async fn",
            "`shared_scope` is a flag",
        ],
    );
}

#[test]
fn policies_and_durations() {
    let spec = check(
        args(quote!(
            in_progress = reject,
            errors = record_if(E::is_final),
            ttl = "1h",
            lease = "2s",
            crate = ::rt
        )),
        quote!(
            async fn f(&self, key: &str) -> anyhow::Result<u8> {
                todo!()
            }
        ),
    )
    .unwrap();
    assert!(matches!(spec.in_progress, InProgress::Reject));
    assert!(matches!(&spec.errors, Errors::RecordIf(p) if path_text(p) == "E::is_final"));
    assert_eq!(spec.ttl, Duration::from_secs(3600));
    assert_eq!(spec.lease, Duration::from_secs(2));
    assert_eq!(spec.krate.to_string(), ":: rt");
    assert!(spec.fingerprinted.is_empty());
}

fn with_manifest(text: &str) -> Env {
    Env {
        manifest: Some(Manifest::parse_named(text, std::path::Path::new("m.toml"))),
        manifest_path: Some("m.toml".into()),
        claim: None,
    }
}

#[test]
fn manifest_and_argument_errors_come_in_one_round() {
    let env = with_manifest("[scopes.\"orders.place\"]\n");
    let Err(err) = check_in(
        quote!(
            scope = "orders.plase",
            key = key,
            tenant = shared,
            ttl = "0s",
            skip(nope)
        ),
        plain_fn(),
        &env,
    ) else {
        panic!("expected errors")
    };
    assert_reports(
        &err,
        &[
            "`ttl` must be longer than zero",
            "no parameter `nope`",
            "did you mean `orders.place`?",
        ],
    );
}

#[test]
fn duplicate_and_argument_errors_come_in_one_round() {
    let place = |line| ClaimPlace {
        krate: "test/one_round".into(),
        file: "src/lib.rs".into(),
        line,
    };
    let env = |line| Env {
        claim: Some(place(line)),
        ..Env::none()
    };
    let first = quote!(
        async fn first(key: &str) -> Result<u8, E> {
            todo!()
        }
    );
    assert!(check_in(
        quote!(scope = "x.y", key = key, tenant = shared),
        first,
        &env(1)
    )
    .is_ok());
    let Err(err) = check_in(
        quote!(
            scope = "x.y",
            key = key,
            tenant = shared,
            errors = sometimes
        ),
        quote!(
            async fn second(key: &str) -> Result<u8, E> {
                todo!()
            }
        ),
        &env(9),
    ) else {
        panic!("expected errors")
    };
    assert!(err.contains("`errors` is `release`"), "{err}");
    assert!(
        err.contains("scope `x.y` is claimed by two functions in this crate"),
        "{err}"
    );
}

#[test]
fn manifest_defaults_apply_and_the_attribute_wins() {
    let env = with_manifest("[scopes.\"a.b\"]\nttl = \"48h\"\nlease = \"5s\"\n");
    let f = plain_fn();
    let spec = check_in(
        quote!(scope = "a.b", key = key, tenant = shared),
        f.clone(),
        &env,
    )
    .unwrap();
    assert_eq!(spec.ttl, Duration::from_secs(48 * 3600));
    assert_eq!(spec.lease, Duration::from_secs(5));
    assert_eq!(
        spec.manifest.as_deref(),
        Some(std::path::Path::new("m.toml"))
    );
    let spec = check_in(
        quote!(scope = "a.b", key = key, tenant = shared, ttl = "1h"),
        f,
        &env,
    )
    .unwrap();
    assert_eq!(spec.ttl, Duration::from_secs(3600));
    assert_eq!(spec.lease, Duration::from_secs(5));
}

#[test]
fn a_syntax_error_does_not_invent_missing_arguments() {
    let err = check_err(
        quote!(scope = "a" key = key, tenant = shared),
        quote!(
            fn f(key: &str) -> Result<u8, E> {
                todo!()
            }
        ),
    );
    assert!(err.contains("expected `,`"), "{err}");
    assert!(
        err.contains("async fn"),
        "the function is still checked: {err}"
    );
    assert!(!err.contains("missing"), "{err}");
}

// ---- the shared verdict table

#[derive(serde::Deserialize)]
struct Verdicts {
    duration: Vec<DurationCase>,
    manifest: Vec<ManifestCase>,
}

#[derive(serde::Deserialize)]
struct DurationCase {
    text: String,
    millis: Option<u64>,
    ttl: String,
    lease: String,
    wait: String,
}

#[derive(serde::Deserialize)]
struct ManifestCase {
    name: String,
    scope: String,
    text: String,
    verdict: String,
    ttl_ms: Option<u64>,
    lease_ms: Option<u64>,
}

const VERDICTS: &str = include_str!("../../rules/tests/verdicts.toml");

/// Asserts `got` (Ok: the value in ms) matches `verdict` ("ok" or "error: <text>").
fn assert_verdict(
    what: &str,
    verdict: &str,
    got: Result<Option<u64>, String>,
    millis: Option<u64>,
) {
    match (verdict.strip_prefix("error: "), got) {
        (None, Ok(value)) => {
            assert_eq!(
                verdict, "ok",
                "{what}: a verdict is \"ok\" or \"error: ...\""
            );
            if let Some(expected) = millis {
                assert_eq!(value, Some(expected), "{what}");
            }
        }
        (None, Err(e)) => panic!("{what}: expected ok, got: {e}"),
        (Some(_), Ok(_)) => panic!("{what}: expected {verdict:?}, got ok"),
        (Some(text), Err(e)) => assert!(e.contains(text), "{what}: expected {text:?} in: {e}"),
    }
}

#[test]
fn verdict_table_durations() {
    let verdicts: Verdicts = toml::from_str(VERDICTS).unwrap();
    assert!(verdicts.duration.len() >= 5);
    for case in &verdicts.duration {
        let text = &case.text;
        // In the attribute.
        for (name, verdict, attr) in [
            ("ttl", &case.ttl, quote!(ttl = #text)),
            ("lease", &case.lease, quote!(lease = #text)),
            ("wait", &case.wait, quote!(in_progress = wait(#text))),
        ] {
            let got = check(
                quote!(scope = "a.b", key = key, tenant = shared, #attr),
                plain_fn(),
            )
            .map(|spec| {
                let d = match name {
                    "ttl" => spec.ttl,
                    "lease" => spec.lease,
                    _ => match spec.in_progress {
                        InProgress::Wait(d) => d,
                        InProgress::Reject => Duration::ZERO,
                    },
                };
                Some(d.as_millis() as u64)
            });
            assert_verdict(
                &format!("attribute {name} = {text:?}"),
                verdict,
                got,
                case.millis,
            );
        }
        // In a manifest entry.
        for (name, verdict) in [("ttl", &case.ttl), ("lease", &case.lease)] {
            let env = with_manifest(&format!("[scopes.\"a.b\"]\n{name} = {text:?}\n"));
            let got = check_in(
                quote!(scope = "a.b", key = key, tenant = shared),
                plain_fn(),
                &env,
            )
            .map(|spec| {
                let d = if name == "ttl" { spec.ttl } else { spec.lease };
                Some(d.as_millis() as u64)
            });
            assert_verdict(
                &format!("manifest {name} = {text:?}"),
                verdict,
                got,
                case.millis,
            );
        }
    }
}

#[test]
fn verdict_table_manifests() {
    let verdicts: Verdicts = toml::from_str(VERDICTS).unwrap();
    assert!(verdicts.manifest.len() >= 5);
    for case in &verdicts.manifest {
        let env = with_manifest(&case.text);
        let scope = &case.scope;
        let got = check_in(
            quote!(scope = #scope, key = key, tenant = shared),
            plain_fn(),
            &env,
        );
        let verdict = case.verdict.replace("MANIFEST", "m.toml");
        match got {
            Ok(spec) => {
                assert_verdict(&case.name, &verdict, Ok(None), None);
                let ms = |d: Duration| d.as_millis() as u64;
                assert_eq!(
                    ms(spec.ttl),
                    case.ttl_ms.unwrap_or(ms(DEFAULT_TTL)),
                    "{}",
                    case.name
                );
                assert_eq!(
                    ms(spec.lease),
                    case.lease_ms.unwrap_or(ms(DEFAULT_LEASE)),
                    "{}",
                    case.name
                );
            }
            Err(e) => assert_verdict(&case.name, &verdict, Err(e), None),
        }
    }
}

/// A second `#[idempotent]` on the function is refused, however its path is
/// written; another crate's attribute of the same name is not ours.
#[test]
fn applied_twice_is_refused_but_not_another_crates_attribute() {
    let attr = quote!(scope = "payments.charge", key = key, tenant = shared);
    for ours in [
        quote!(#[idempotent(scope = "a.b", key = key, tenant = shared)]),
        quote!(#[idempotent_runtime::idempotent(scope = "a.b", key = key, tenant = shared)]),
        quote!(#[::idempotent_runtime::idempotent(scope = "a.b", key = key, tenant = shared)]),
    ] {
        let err = check_err(
            attr.clone(),
            quote!(#ours async fn charge(key: &str) -> Result<u8, E> { todo!() }),
        );
        assert!(err.contains("written twice"), "{ours}: {err}");
    }
    check(
        attr,
        quote!(
            #[other_crate::idempotent]
            async fn charge(key: &str) -> Result<u8, E> {
                todo!()
            }
        ),
    )
    .expect("another crate's attribute");
}

/// `store = self.store` on a method owning `self`: a receiver naming its
/// type (`self: Ledger`) is `self` by value, so a body using other fields
/// passes, while a pointer naming it (`self: Box<Ledger>`) or `&mut Self`
/// still owns `self` whole; a `use` declaration's `self` is a module's, and
/// a by-value `self` matched against a pattern moves only what it binds.
#[test]
fn store_borrowed_from_an_owned_self_tells_a_named_type_from_a_pointer() {
    let attr = quote!(
        scope = "s.owned",
        key = key,
        tenant = shared,
        store = self.store,
        skip(self)
    );
    let passes = [
        quote!(
            async fn f(self: Ledger, key: &str) -> Result<u8, E> {
                Ok(self.amount)
            }
        ),
        quote!(
            async fn f(mut self: Ledger<T>, key: &str) -> Result<u8, E> {
                Ok(self.amount)
            }
        ),
        quote!(
            async fn f(self, key: &str) -> Result<u8, E> {
                use std::fmt::{self, Write};
                Ok(self.amount)
            }
        ),
        quote!(
            async fn f(self: Arc<Self>, key: &str) -> Result<u8, E> {
                use std::io::{self};
                Ok(1)
            }
        ),
        quote!(
            async fn f(self, key: &str) -> Result<u8, E> {
                let Self { amount, .. } = self;
                Ok(amount)
            }
        ),
        quote!(
            async fn f(self, key: &str) -> Result<u8, E> {
                match self {
                    Ledger { amount, .. } => Ok(amount),
                }
            }
        ),
    ];
    for func in passes {
        let shown = func.to_string();
        check(attr.clone(), func).unwrap_or_else(|e| panic!("{shown}: {e}"));
    }
    let refused = [
        quote!(
            async fn f(self: Box<Ledger>, key: &str) -> Result<u8, E> {
                Ok(self.amount)
            }
        ),
        quote!(
            async fn f(self: Pin<Box<Self>>, key: &str) -> Result<u8, E> {
                Ok(self.amount)
            }
        ),
        quote!(
            async fn f(self: &mut Self, key: &str) -> Result<u8, E> {
                Ok(self.amount)
            }
        ),
        quote!(
            async fn f(self: Ledger, key: &str) -> Result<u8, E> {
                Ok(self.store.len())
            }
        ),
        quote!(
            async fn f(self, key: &str) -> Result<u8, E> {
                use std::fmt::{self, Write};
                Ok(self.count())
            }
        ),
        quote!(
            async fn f(self, key: &str) -> Result<u8, E> {
                let same = other == self;
                Ok(1)
            }
        ),
        quote!(
            async fn f(self: Arc<Self>, key: &str) -> Result<u8, E> {
                let Self { amount, .. } = &*self;
                Ok(*amount)
            }
        ),
    ];
    for func in refused {
        let shown = func.to_string();
        let e = check_err(attr.clone(), func);
        assert!(e.contains("borrows the store from `self`"), "{shown}: {e}");
    }
}
