//! Code generation. The signature, attributes and visibility are re-emitted as
//! written (original spans); only the body is wrapped, and everything the
//! wrapper does is a call into `idempotent_runtime::__private`.

use crate::args::{self, Errors, InProgress, RawArgs, Spec, Tenant};
use crate::{claims, manifest};
use proc_macro2::{Ident, Span, TokenStream};
use quote::{quote, quote_spanned};
use std::path::PathBuf;
use std::time::Duration;
use syn::spanned::Spanned;
use syn::ItemFn;

const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);
const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// The whole macro: on any error, the original item plus every error, so one
/// mistake does not cascade into "function not found" errors elsewhere.
pub(crate) fn entry(attr: TokenStream, item: TokenStream) -> TokenStream {
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(e) => {
            let e = syn::Error::new(
                e.span(),
                format!(
                    "#[idempotent] goes on an `async fn` with a body: a free function, or a \
                     method in an `impl` block (not a trait's declaration): {e}"
                ),
            );
            return with_error(item, e);
        }
    };
    let raw: RawArgs = match syn::parse2(attr) {
        Ok(raw) => raw,
        Err(e) => return with_error(item, e),
    };
    let spec = match args::validate(raw, &func, Span::call_site()) {
        Ok(spec) => spec,
        Err(e) => return with_error(item, e),
    };
    match compile_time_checks(&func, &spec) {
        Ok(resolved) => generate(&func, &spec, &resolved),
        Err(e) => with_error(item, e),
    }
}

/// The item as written (so callers still compile) plus the errors. Unused
/// parameters are expected while the attribute is broken; do not add noise.
fn with_error(item: TokenStream, error: syn::Error) -> TokenStream {
    let error = error.to_compile_error();
    quote!(#[allow(unused_variables)] #item #error)
}

/// What the manifest added.
pub(crate) struct Resolved {
    ttl: Duration,
    lease: Duration,
    manifest: Option<PathBuf>,
}

/// The manifest (membership, retirement, defaults) and the one-function-per-scope rule.
fn compile_time_checks(func: &ItemFn, spec: &Spec) -> Result<Resolved, syn::Error> {
    let scope = spec.scope.value();
    let mut errs = args::Errs::default();
    let mut resolved = Resolved {
        ttl: spec.ttl.unwrap_or(DEFAULT_TTL),
        lease: spec.lease.unwrap_or(DEFAULT_LEASE),
        manifest: None,
    };
    match manifest::locate() {
        Err(message) => errs.push(spec.scope.span(), message),
        Ok(None) => {}
        Ok(Some(path)) => {
            match manifest::load(&path).and_then(|m| manifest::check(&m, &scope, &path)) {
                Ok(defaults) => {
                    resolved.ttl = spec.ttl.or(defaults.ttl).unwrap_or(DEFAULT_TTL);
                    resolved.lease = spec.lease.or(defaults.lease).unwrap_or(DEFAULT_LEASE);
                }
                Err(message) => errs.push(spec.scope.span(), message),
            }
            resolved.manifest = Some(path);
        }
    }
    // A function under `#[cfg]` may have a twin under the opposite cfg claiming
    // the same scope; only claim functions that are certainly compiled.
    let has_cfg = func.attrs.iter().any(|a| a.path().is_ident("cfg"));
    // Without cargo's crate name (a tool expanding outside cargo) claims from
    // different crates could not be told apart; skip rather than misreport.
    let in_cargo = std::env::var_os("CARGO_CRATE_NAME").is_some();
    if proc_macro::is_available() && !has_cfg && in_cargo {
        let name = &func.sig.ident;
        let span = name.span().unwrap();
        let site = claims::Site {
            function: name.to_string(),
            file: span.file(),
            line: span.line(),
        };
        let claim = claims::Claim {
            site: site.clone(),
            shared: spec.shared_scope,
            fingerprint: spec.fingerprint.then(|| {
                let mut names: Vec<String> =
                    spec.fingerprinted.iter().map(|i| i.to_string()).collect();
                names.sort();
                names
            }),
            ttl: resolved.ttl,
        };
        match claims::claim(&claims::current_crate(), &scope, claim) {
            Ok(()) => {}
            Err(claims::Refusal::Duplicate { others }) => {
                errs.push(spec.scope.span(), duplicate_message(&scope, &others, &site))
            }
            Err(claims::Refusal::Disagree { other, what }) => errs.push(
                spec.scope.span(),
                format!(
                    "scope `{scope}` is shared (`shared_scope`) by {} and {}, but {what}",
                    other.site, site
                ),
            ),
        }
    }
    match errs.into_error() {
        Some(e) => Err(e),
        None => Ok(resolved),
    }
}

/// The duplicate-scope error (rule 18), naming every site; with a hint about
/// `shared_scope` (rule 21) when some claimants already say it.
fn duplicate_message(scope: &str, others: &[claims::Claim], site: &claims::Site) -> String {
    let mut sites: Vec<String> = others.iter().map(|c| c.site.to_string()).collect();
    sites.push(site.to_string());
    let last = sites.pop().unwrap_or_default();
    let count = if sites.len() == 1 {
        "two functions".to_owned()
    } else {
        format!("{} functions", sites.len() + 1)
    };
    let listed = format!("{} and {last}", sites.join(", "));
    let shared: Vec<String> = others
        .iter()
        .filter(|c| c.shared)
        .map(|c| c.site.to_string())
        .collect();
    let hint = if shared.is_empty() {
        "give each function its own scope, or, if they are meant to share one deduplication \
         boundary (e.g. an HTTP handler and a queue consumer of one business event), write \
         `shared_scope` on every one of them"
            .to_owned()
    } else {
        let verb = if shared.len() == 1 { "says" } else { "say" };
        format!(
            "{} {verb} `shared_scope`, so sharing is meant: write `shared_scope` on every \
             claimant, or give this function its own scope",
            shared.join(" and ")
        )
    };
    format!(
        "scope `{scope}` is claimed by {count} in this crate: {listed}. Records are identified by \
         scope, so they would replay each other's results; {hint}"
    )
}

fn duration(krate: &TokenStream, d: Duration) -> TokenStream {
    let millis = d.as_millis();
    if d.subsec_nanos().is_multiple_of(1_000_000) && u64::try_from(millis).is_ok() {
        let millis = millis as u64;
        quote!(#krate::__private::Duration::from_millis(#millis))
    } else {
        let (secs, nanos) = (d.as_secs(), d.subsec_nanos());
        quote!(#krate::__private::Duration::new(#secs, #nanos))
    }
}

pub(crate) fn generate(func: &ItemFn, spec: &Spec, resolved: &Resolved) -> TokenStream {
    let krate = &spec.krate;
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
    } = func;
    let name = &sig.ident;
    let name_text = name.to_string();
    let scope = &spec.scope;
    let ret = match &sig.output {
        syn::ReturnType::Type(_, ty) => quote!(#ty),
        syn::ReturnType::Default => quote!(()), // unreachable: validated to be a Result
    };

    let file = quote_spanned!(name.span()=> file!());
    let line = quote_spanned!(name.span()=> line!());
    let ttl = duration(krate, resolved.ttl);
    let lease = duration(krate, resolved.lease);
    let in_progress = match spec.in_progress {
        InProgress::Wait(d) => {
            let d = duration(krate, d);
            quote!(#krate::__private::InProgressPolicy::Wait(#d))
        }
        InProgress::Reject => quote!(#krate::__private::InProgressPolicy::Reject),
    };
    let (error_policy, error_handling) = match &spec.errors {
        Errors::Release => (
            quote!(#krate::__private::ErrorPolicy::Release),
            quote!(#krate::__private::ReleaseErrors),
        ),
        Errors::Record => (
            quote!(#krate::__private::ErrorPolicy::Record),
            quote!(#krate::__private::RecordErrors),
        ),
        Errors::RecordIf(path) => {
            let text = args::path_text(path);
            (
                quote!(#krate::__private::ErrorPolicy::RecordIf(#text)),
                quote!(#krate::__private::RecordErrorsIf(#path)),
            )
        }
    };
    let transactional = spec.tx.is_some();
    let fingerprinted = spec.fingerprint;
    let shared = matches!(spec.tenant, Tenant::Shared);
    let fp_names: Vec<String> = spec.fingerprinted.iter().map(|i| i.to_string()).collect();

    let manifest_tracking = resolved.manifest.as_ref().map(|p| {
        let p = p.display().to_string();
        quote!(
            const _: &[u8] = ::core::include_bytes!(#p);
        )
    });

    let key = &spec.key;
    let identity = match &spec.tenant {
        Tenant::Shared => {
            quote!(#krate::__private::shared_identity(&__IDEMPOTENT_SCOPE, &(#key)))
        }
        Tenant::Expr(tenant) => {
            quote!(#krate::__private::identity(&__IDEMPOTENT_SCOPE, &(#tenant), &(#key)))
        }
    };
    let fingerprint = if spec.fingerprinted.is_empty() {
        quote!(::core::result::Result::Ok(::core::option::Option::None))
    } else {
        // Spanned at each parameter, so "`T` is not Serialize" points at it. The
        // builder's name keeps the attribute's span, as where it is declared: a
        // function written at a `macro_rules!` call site and an attribute written
        // in the macro are two hygiene contexts, and a name spanned at the
        // parameter would not see a binding spanned at the attribute.
        let builder = Ident::new("__idempotent_fp", Span::call_site());
        let arguments = spec.fingerprinted.iter().map(|name| {
            let text = name.to_string();
            quote_spanned!(name.span()=> #builder.argument(#text, &#name);)
        });
        quote!({
            let mut #builder = #krate::__private::FingerprintBuilder::new();
            #(#arguments)*
            #builder.finish()
        })
    };

    let recover_name = spec.recover.as_ref().map(|p| {
        let text = args::path_text(p);
        quote!(.__recover(#text))
    });
    let shared_scope = spec.shared_scope.then(|| quote!(.__shared_scope()));
    let recover = match &spec.recover {
        None => quote!(#krate::__private::NoRecover),
        Some(path) => {
            // One binding, named with the attribute's span and used inside the
            // path's span, so it is the same name under any hygiene.
            let takeover = Ident::new("__idempotent_takeover", Span::call_site());
            let ask = quote_spanned!(path.span()=> #path(&#takeover).await);
            quote!(#krate::__private::RecoverWith(
                move |#takeover: #krate::__private::Takeover| async move {
                    #krate::__private::recovery::<#ret>(#ask)
                }
            ))
        }
    };

    let prelude = quote! {
        static __IDEMPOTENT_SCOPE: #krate::__private::ScopeInfo = #krate::__private::ScopeInfo::__new(
            #scope,
            ::core::concat!(::core::module_path!(), "::", #name_text),
            #file,
            #line,
            #ttl,
            #lease,
            #in_progress,
            #error_policy,
            #transactional,
            #fingerprinted,
            &[#(#fp_names),*],
            #shared,
        )#recover_name #shared_scope;
        #krate::__private::inventory::submit! {
            #krate::__private::Registration(&__IDEMPOTENT_SCOPE)
        }
        const _: ::core::option::Option<&str> = ::core::option_env!("IDEMPOTENT_MANIFEST");
        #manifest_tracking
    };

    let body = match &spec.tx {
        None => {
            let store = match &spec.store {
                None => quote!(#krate::__private::default_store(&__IDEMPOTENT_SCOPE)),
                Some(_) => quote!({
                    use #krate::__private::AsDynStore as _;
                    #krate::__private::store(__idempotent_store.as_dyn_store())
                }),
            };
            // `&(expr)` keeps a place expression (`self.store`) borrowed rather than
            // moved, and extends a temporary's life (`store = handle.clone()`).
            let bind_store = spec
                .store
                .as_ref()
                .map(|expr| quote!(let __idempotent_store = &(#expr);));
            quote! {
                #prelude
                #bind_store
                let __idempotent_call = #krate::__private::Call {
                    spec: &__IDEMPOTENT_SCOPE,
                    store: #store,
                    identity: #identity,
                    fingerprint: #fingerprint,
                };
                #krate::__private::execute::<#ret, _, _, _>(
                    __idempotent_call,
                    #error_handling,
                    #recover,
                    #krate::__private::body::<#ret, _>(async move #block),
                )
                .await
            }
        }
        Some(tx) => quote! {
            #prelude
            let __idempotent_call = #krate::__private::TransactionalCall {
                spec: &__IDEMPOTENT_SCOPE,
                identity: #identity,
                fingerprint: #fingerprint,
            };
            let __idempotent_errors = #error_handling;
            let __idempotent_held = match #krate::__private::begin_in_transaction::<#ret, _, _, _>(
                __idempotent_call,
                &__idempotent_errors,
                #recover,
                &mut *#tx,
            )
            .await
            {
                #krate::__private::TransactionStep::Return(__idempotent_early) => {
                    return __idempotent_early
                }
                #krate::__private::TransactionStep::Run(__idempotent_held) => __idempotent_held,
            };
            // Not `move`: the transaction is used again after the body.
            let __idempotent_result: #ret = #krate::__private::in_span(
                &__idempotent_held,
                #krate::__private::body::<#ret, _>(async #block),
            )
            .await;
            #krate::__private::finish_in_transaction::<#ret, _, _>(
                __idempotent_held,
                &__idempotent_errors,
                &mut *#tx,
                __idempotent_result,
            )
            .await
        },
    };

    quote! {
        #(#attrs)*
        #vis #sig {
            #body
        }
    }
}
