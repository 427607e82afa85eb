//! Parsing and validating the attribute's arguments against the function.
//!
//! Parsing is lenient about shape (`name = expr`, `name(...)` or a bare name)
//! so that validation can look at every argument and report every mistake at
//! once, each spanned at the offending token.
//!
//! An argument passed through a `macro_rules!` metavariable (`scope = $s` with
//! `$s:literal`, `key = $k` with `$k:expr`, `$p:path`, `$t:ty`) arrives wrapped
//! in an invisible (`Delimiter::None`) group, which syn parses as
//! `Expr::Group`. Every check of an argument's shape goes through `ungroup`
//! first, so such an argument behaves exactly as if written directly, and
//! messages are spanned at the user's token inside the group (the group's own
//! span is the `$s` in the macro's definition). Identifiers inside a group
//! (`skip($a)`, an argument's name) are seen through by syn's cursor itself.

use crate::duration::{self, Kind};
use crate::scope;
use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use std::time::Duration;
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Expr, ExprLit, FnArg, Ident, ItemFn, Lit, LitStr, Pat, Path, ReturnType, Token, Type};

/// Every argument the attribute accepts, in the order the docs list them.
pub(crate) const KNOWN: &[&str] = &[
    "scope",
    "key",
    "tenant",
    "store",
    "tx",
    "skip",
    "fingerprint",
    "ttl",
    "lease",
    "in_progress",
    "errors",
    "recover",
    "shared_scope",
    "crate",
];

/// One argument as written.
pub(crate) struct RawArg {
    pub name: Ident,
    pub value: RawValue,
}

pub(crate) enum RawValue {
    /// `name`
    Bare,
    /// `name = expr`
    Eq(Expr),
    /// `name(...)`
    List(TokenStream),
}

/// The whole attribute as written.
pub(crate) struct RawArgs(pub Vec<RawArg>);

impl Parse for RawArgs {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let mut args = Vec::new();
        while !input.is_empty() {
            let name = input.call(Ident::parse_any)?;
            let value = if input.peek(Token![=]) {
                input.parse::<Token![=]>()?;
                RawValue::Eq(input.parse()?)
            } else if input.peek(syn::token::Paren) {
                let content;
                syn::parenthesized!(content in input);
                RawValue::List(content.parse()?)
            } else {
                RawValue::Bare
            };
            args.push(RawArg { name, value });
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        Ok(RawArgs(args))
    }
}

/// `tenant = <expr> | shared`.
pub(crate) enum Tenant {
    Expr(Expr),
    Shared,
}

/// `in_progress = wait("10s") | reject`.
pub(crate) enum InProgress {
    Wait(Duration),
    Reject,
}

/// `errors = release | record | record_if(path)`.
pub(crate) enum Errors {
    Release,
    Record,
    RecordIf(Path),
}

/// A parameter of the annotated function, as far as the fingerprint cares.
pub(crate) struct Param {
    /// `None` for a pattern (`(a, b): (u8, u8)`, `_`).
    pub name: Option<Ident>,
    /// Where to point at in messages.
    pub span: Span,
    pub is_self: bool,
    /// `_: T`
    pub is_wildcard: bool,
}

/// Everything the attribute and the function declare, validated.
pub(crate) struct Spec {
    pub scope: LitStr,
    pub key: Expr,
    pub tenant: Tenant,
    pub store: Option<Expr>,
    pub tx: Option<Ident>,
    pub fingerprint: bool,
    /// `None`: not written; the manifest's default or 24h applies.
    pub ttl: Option<Duration>,
    /// `None`: not written; the manifest's default or 30s applies.
    pub lease: Option<Duration>,
    pub in_progress: InProgress,
    pub errors: Errors,
    /// `recover = path`: asked before a takeover re-runs the body (rule 20).
    pub recover: Option<Path>,
    /// `shared_scope`: the scope is claimed by several functions on purpose (rule 21).
    pub shared_scope: bool,
    pub krate: TokenStream,
    /// The parameters that go into the fingerprint, in declaration order.
    pub fingerprinted: Vec<Ident>,
}

/// Collects errors; combines them into one at the end.
#[derive(Default)]
pub(crate) struct Errs(Vec<syn::Error>);

impl Errs {
    pub fn push(&mut self, span: Span, message: impl std::fmt::Display) {
        self.0.push(syn::Error::new(span, message));
    }
    pub fn add(&mut self, error: syn::Error) {
        self.0.push(error);
    }
    pub fn into_error(self) -> Option<syn::Error> {
        let mut all = self.0.into_iter();
        let mut first = all.next()?;
        for e in all {
            first.combine(e);
        }
        Some(first)
    }
}

/// `expr` without the invisible groups `macro_rules!` wraps around a
/// metavariable (`$s:literal`, `$e:expr`, `$p:path`); nested macros can leave
/// several, one inside the other.
pub(crate) fn ungroup(mut expr: &Expr) -> &Expr {
    while let Expr::Group(g) = expr {
        expr = &g.expr;
    }
    expr
}

/// Where to point at for a mistake in `expr`: the user's tokens, not an
/// invisible group's span (which is the metavariable in the macro's definition).
fn span_of(expr: &Expr) -> Span {
    ungroup(expr).span()
}

fn lit_str(expr: &Expr) -> Option<&LitStr> {
    match ungroup(expr) {
        Expr::Lit(ExprLit {
            lit: Lit::Str(s), ..
        }) => Some(s),
        _ => None,
    }
}

/// The identifier when `expr` is exactly a single identifier (`key`, not
/// `req.key`), possibly in parentheses or passed through a metavariable.
pub(crate) fn plain_ident(expr: &Expr) -> Option<&Ident> {
    match ungroup(expr) {
        Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => p.path.get_ident(),
        Expr::Paren(p) => plain_ident(&p.expr),
        _ => None,
    }
}

/// Whether `tenant = <expr>` is the `shared` opt-out: the bare identifier
/// `shared`, nothing else. `tenant = (shared)` is an expression naming a
/// parameter called `shared`, so parentheses are deliberately not looked through.
/// A metavariable's invisible group is: `tenant = $t` with `$t:expr` given
/// `shared` is the opt-out, as `tenant = shared` written directly is (and as
/// `$t:ident` is, which arrives without a group).
fn is_shared_opt_out(expr: &Expr) -> bool {
    matches!(ungroup(expr), Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() && p.path.is_ident("shared"))
}

fn parse_duration_lit(expr: &Expr, kind: Kind, name: &str, errs: &mut Errs) -> Option<Duration> {
    let Some(lit) = lit_str(expr) else {
        errs.push(
            span_of(expr),
            format!("`{name}` takes a duration in a string literal, e.g. `{name} = \"30s\"`"),
        );
        return None;
    };
    match duration::parse(&lit.value(), kind) {
        Ok(d) => Some(d),
        Err(message) => {
            errs.push(lit.span(), message);
            None
        }
    }
}

/// Reads the function's parameters.
pub(crate) fn params(func: &ItemFn) -> Vec<Param> {
    func.sig
        .inputs
        .iter()
        .map(|input| match input {
            FnArg::Receiver(r) => Param {
                name: Some(Ident::new("self", r.self_token.span)),
                span: r.span(),
                is_self: true,
                is_wildcard: false,
            },
            FnArg::Typed(t) => match &*t.pat {
                Pat::Ident(p) if p.subpat.is_none() => Param {
                    name: Some(p.ident.clone()),
                    span: p.ident.span(),
                    is_self: p.ident == "self",
                    is_wildcard: false,
                },
                other => Param {
                    name: None,
                    span: other.span(),
                    is_self: false,
                    is_wildcard: matches!(other, Pat::Wild(_)),
                },
            },
        })
        .collect()
}

/// `ty` without the invisible groups around a `$t:ty` metavariable.
fn ungroup_type(mut ty: &Type) -> &Type {
    while let Type::Group(g) = ty {
        ty = &g.elem;
    }
    ty
}

/// Whether the return type's last path segment is `Result` (so `io::Result<T>`
/// and `anyhow::Result<T>` are accepted; the runtime's trait bounds check the rest).
fn returns_result(output: &ReturnType) -> bool {
    let ReturnType::Type(_, ty) = output else {
        return false;
    };
    matches!(ungroup_type(ty), Type::Path(p) if p.qself.is_none()
        && p.path.segments.last().is_some_and(|s| s.ident == "Result"))
}

/// Validates the arguments against the function. Returns the spec, or every error found.
pub(crate) fn validate(raw: RawArgs, func: &ItemFn, attr_span: Span) -> Result<Spec, syn::Error> {
    let mut errs = Errs::default();
    let sig = &func.sig;

    // ---- the function itself
    if sig.asyncness.is_none() {
        errs.push(
            sig.fn_token.span,
            "#[idempotent] works on `async fn` only: the reservation and the recorded result \
             are store calls that must be awaited; make this function `async`",
        );
    }
    if !returns_result(&sig.output) {
        let span = match &sig.output {
            ReturnType::Type(_, ty) => ungroup_type(ty).span(),
            ReturnType::Default => sig.paren_token.span.join(),
        };
        errs.push(
            span,
            "#[idempotent] functions must return `Result<T, E>` (T: Serialize + Deserialize, \
             E: From<idempotent_runtime::Error>), so a refusal or a store failure can be \
             returned as an error; change the return type",
        );
    }
    let params = params(func);

    // ---- arguments: shape, repetition, unknown names
    let mut seen: Vec<String> = Vec::new();
    let mut scope_arg = None;
    let mut key = None;
    let mut tenant = None;
    let mut store = None;
    let mut tx: Option<Ident> = None;
    let mut skip: Option<(Ident, Vec<Ident>)> = None;
    let mut fingerprint: Option<(Ident, bool)> = None;
    let mut ttl = None;
    let mut lease = None;
    let mut in_progress = InProgress::Wait(Duration::from_secs(10));
    let mut errors = Errors::Release;
    let mut recover: Option<Path> = None;
    let mut shared_scope = false;
    let mut krate: Option<TokenStream> = None;

    for RawArg { name, value } in raw.0 {
        let n = name.unraw().to_string();
        if !KNOWN.contains(&n.as_str()) {
            let hint = scope::nearest(&n, KNOWN.iter().copied(), Some(3))
                .map(|s| format!("did you mean `{s}`? "))
                .unwrap_or_default();
            errs.push(
                name.span(),
                format!(
                    "unknown argument `{n}`; {hint}#[idempotent] accepts: {}",
                    KNOWN.join(", ")
                ),
            );
            continue;
        }
        if seen.contains(&n) {
            errs.push(
                name.span(),
                format!("`{n}` is given more than once; keep one"),
            );
            continue;
        }
        seen.push(n.clone());
        let expr = match (n.as_str(), value) {
            ("skip", RawValue::List(tokens)) => {
                let parser = |input: ParseStream| {
                    Punctuated::<Ident, Token![,]>::parse_terminated_with(input, Ident::parse_any)
                };
                match syn::parse::Parser::parse2(parser, tokens) {
                    Ok(names) => skip = Some((name, names.into_iter().collect())),
                    Err(e) => errs.add(syn::Error::new(
                        e.span(),
                        "`skip` lists parameter names: `skip(a, b)`",
                    )),
                }
                continue;
            }
            ("skip", _) => {
                errs.push(
                    name.span(),
                    "`skip` lists parameter names in parentheses: `skip(a, b)`",
                );
                continue;
            }
            ("shared_scope", RawValue::Bare) => {
                shared_scope = true;
                continue;
            }
            ("shared_scope", _) => {
                errs.push(
                    name.span(),
                    "`shared_scope` is a flag and takes no value: write `shared_scope` alone, on \
                     every function that claims the scope on purpose",
                );
                continue;
            }
            (_, RawValue::Eq(expr)) => expr,
            (_, RawValue::Bare | RawValue::List(_)) => {
                errs.push(
                    name.span(),
                    format!("`{n}` needs a value: {}", example_for(&n)),
                );
                continue;
            }
        };
        match n.as_str() {
            "scope" => match lit_str(&expr) {
                Some(lit) => {
                    if let Err(message) = scope::check_format(&lit.value()) {
                        errs.push(lit.span(), message);
                    }
                    scope_arg = Some(lit.clone());
                }
                None => errs.push(
                    span_of(&expr),
                    "`scope` must be a string literal, e.g. `scope = \"payments.charge\"`; \
                     the scope is checked when the code compiles, so it cannot be computed",
                ),
            },
            "key" => key = Some(expr),
            "tenant" => {
                tenant = Some(if is_shared_opt_out(&expr) {
                    // A parameter called `shared` would make the bare word mean
                    // two things: refuse rather than silently merge tenants.
                    if params.iter().any(|p| p.name.as_ref().is_some_and(|n| n == "shared")) {
                        errs.push(
                            span_of(&expr),
                            "`tenant = shared` is the opt-out (one namespace for every tenant), \
                             but this function also has a parameter called `shared`; \
                             write `tenant = (shared)` to use the parameter as the tenant, \
                             or rename the parameter",
                        );
                    }
                    Tenant::Shared
                } else {
                    Tenant::Expr(expr)
                })
            }
            "store" => store = Some(expr),
            "tx" => match plain_ident(&expr) {
                Some(id) if params.iter().any(|p| !p.is_self && p.name.as_ref() == Some(id)) => {
                    tx = Some(id.clone())
                }
                _ => errs.push(
                    span_of(&expr),
                    format!(
                        "`tx` must name a parameter of this function holding the transaction \
                         or connection, e.g. `tx = tx` for `tx: &mut sqlx::Transaction<'_, Postgres>`; \
                         parameters: {}",
                        param_list(&params)
                    ),
                ),
            },
            "fingerprint" => match ungroup(&expr) {
                Expr::Lit(ExprLit {
                    lit: Lit::Bool(b), ..
                }) => fingerprint = Some((name, b.value)),
                _ => errs.push(
                    span_of(&expr),
                    "`fingerprint` is `true` or `false`: `fingerprint = false` turns the \
                     fingerprint off",
                ),
            },
            "ttl" => ttl = parse_duration_lit(&expr, Kind::Ttl, "ttl", &mut errs),
            "lease" => lease = parse_duration_lit(&expr, Kind::Lease, "lease", &mut errs),
            "in_progress" => {
                if let Some(p) = parse_in_progress(&expr, &mut errs) {
                    in_progress = p
                }
            }
            "errors" => {
                if let Some(e) = parse_errors(&expr, &mut errs) {
                    errors = e
                }
            }
            "recover" => match ungroup(&expr) {
                Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => {
                    recover = Some(p.path.clone())
                }
                _ => errs.push(
                    span_of(&expr),
                    "`recover` takes the path of an `async fn(&idempotent_runtime::Takeover) -> \
                     Result<idempotent_runtime::Recovery<T>, E>` (T and E this function's), e.g. \
                     `recover = charge_happened`",
                ),
            },
            "crate" => match ungroup(&expr) {
                Expr::Path(p) if p.qself.is_none() => krate = Some(p.path.to_token_stream()),
                _ => errs.push(
                    span_of(&expr),
                    "`crate` takes the path of the runtime crate, e.g. `crate = ::my_idempotent`",
                ),
            },
            _ => unreachable!("every name in KNOWN is handled"),
        }
    }

    // ---- required arguments (spanned at the whole attribute)
    for (present, name) in [
        (seen.iter().any(|s| s == "scope"), "scope"),
        (key.is_some() || seen.iter().any(|s| s == "key"), "key"),
        (
            tenant.is_some() || seen.iter().any(|s| s == "tenant"),
            "tenant",
        ),
    ] {
        if !present {
            errs.push(
                attr_span,
                format!("missing `{name}`: {}", example_for(name)),
            );
        }
    }

    // ---- combinations
    if let (Some(tx), Some(store)) = (&tx, &store) {
        let mut e = syn::Error::new(
            tx.span(),
            "`tx` and `store` cannot be used together: with `tx` the records live in the \
             transaction's database; remove `store`",
        );
        e.combine(syn::Error::new(span_of(store), "`store` given here"));
        errs.add(e);
    }
    let fingerprint_on = fingerprint.as_ref().is_none_or(|(_, on)| *on);
    if let (Some((fp_name, false)), Some((skip_name, _))) = (&fingerprint, &skip) {
        let mut e = syn::Error::new(
            skip_name.span(),
            "`skip(...)` has no effect with `fingerprint = false` (nothing is fingerprinted); \
             remove one of them",
        );
        e.combine(syn::Error::new(
            fp_name.span(),
            "`fingerprint = false` given here",
        ));
        errs.add(e);
    }

    // ---- skip names must be parameters
    let skipped: Vec<Ident> = skip.map(|(_, names)| names).unwrap_or_default();
    for (i, name) in skipped.iter().enumerate() {
        if skipped[..i].contains(name) {
            errs.push(name.span(), format!("`{name}` is listed twice in `skip`"));
            continue;
        }
        if !params.iter().any(|p| p.name.as_ref() == Some(name)) {
            let named: Vec<String> = params
                .iter()
                .filter_map(|p| p.name.as_ref().map(|n| n.to_string()))
                .collect();
            let hint = scope::nearest(&name.to_string(), named.iter().map(String::as_str), Some(3))
                .map(|s| format!("did you mean `{s}`? "))
                .unwrap_or_default();
            errs.push(
                name.span(),
                format!(
                    "`skip` names `{name}`, but `{}` has no parameter `{name}`; {hint}parameters: {}",
                    sig.ident,
                    param_list(&params)
                ),
            );
        }
    }

    // ---- which parameters are fingerprinted
    let named_directly: Vec<&Ident> = [
        key.as_ref().and_then(plain_ident),
        match &tenant {
            Some(Tenant::Expr(e)) => plain_ident(e),
            _ => None,
        },
        store.as_ref().and_then(plain_ident),
        tx.as_ref(),
    ]
    .into_iter()
    .flatten()
    .collect();
    let mut fingerprinted = Vec::new();
    if fingerprint_on {
        for p in &params {
            if p.is_self {
                continue;
            }
            match &p.name {
                Some(n) if named_directly.contains(&n) || skipped.contains(n) => {}
                Some(n) => fingerprinted.push(n.clone()),
                None if p.is_wildcard => errs.push(
                    p.span,
                    "a `_` parameter cannot be fingerprinted because it has no name; name it \
                     (`_unused: u8`) and list it in `skip(...)` if it is not part of the \
                     request, or turn the fingerprint off with `fingerprint = false`",
                ),
                None => errs.push(
                    p.span,
                    "this parameter is a pattern, so #[idempotent] cannot name it in the \
                     fingerprint; bind it to a name (`pair: (u8, u8)`) and destructure it in \
                     the body, or turn the fingerprint off with `fingerprint = false`",
                ),
            }
        }
    }

    if let Some(e) = errs.into_error() {
        return Err(e);
    }
    match (scope_arg, key, tenant) {
        (Some(scope), Some(key), Some(tenant)) => Ok(Spec {
            scope,
            key,
            tenant,
            store,
            tx,
            fingerprint: fingerprint_on,
            ttl,
            lease,
            in_progress,
            errors,
            recover,
            shared_scope,
            krate: krate.unwrap_or_else(|| quote::quote!(::idempotent_runtime)),
            fingerprinted,
        }),
        // Each missing one was reported above; unreachable in practice.
        _ => Err(syn::Error::new(
            attr_span,
            "missing `scope`, `key` or `tenant`",
        )),
    }
}

fn param_list(params: &[Param]) -> String {
    let names: Vec<String> = params
        .iter()
        .map(|p| match &p.name {
            Some(n) => format!("`{n}`"),
            None => "(a pattern)".to_owned(),
        })
        .collect();
    if names.is_empty() {
        "(none)".to_owned()
    } else {
        names.join(", ")
    }
}

fn example_for(name: &str) -> &'static str {
    match name {
        "scope" => "`scope = \"payments.charge\"` names the operation; it is part of every record's identity",
        "key" => "`key = <expression>` gives the client-supplied idempotency key, e.g. `key = key` or `key = req.idempotency_key`",
        "tenant" => "`tenant = <expression>` says whose key it is, e.g. `tenant = account.id`; write `tenant = shared` if keys are global",
        "store" => "`store = <expression>`, e.g. `store = self.store` or `store = store`",
        "tx" => "`tx = <parameter>`, e.g. `tx = tx`",
        "fingerprint" => "`fingerprint = false`",
        "ttl" => "`ttl = \"24h\"`",
        "lease" => "`lease = \"30s\"`",
        "in_progress" => "`in_progress = wait(\"10s\")` or `in_progress = reject`",
        "errors" => "`errors = release`, `errors = record` or `errors = record_if(path::to::predicate)`",
        "recover" => "`recover = path::to::hook`, an `async fn(&Takeover) -> Result<Recovery<T>, E>` asked before a takeover re-runs the body",
        "shared_scope" => "`shared_scope` (a flag, no value)",
        "crate" => "`crate = ::path::to::idempotent_runtime`",
        _ => "see the #[idempotent] documentation",
    }
}

fn parse_in_progress(expr: &Expr, errs: &mut Errs) -> Option<InProgress> {
    const HELP: &str =
        "`in_progress` is `wait(\"10s\")` (wait up to that long for the first call's result) \
         or `reject` (refuse a concurrent duplicate at once)";
    match ungroup(expr) {
        Expr::Path(p) if p.path.is_ident("reject") => Some(InProgress::Reject),
        Expr::Path(p) if p.path.is_ident("wait") => {
            errs.push(
                span_of(expr),
                "`wait` needs a duration: `in_progress = wait(\"10s\")`",
            );
            None
        }
        Expr::Call(call) if matches!(ungroup(&call.func), Expr::Path(p) if p.path.is_ident("wait")) =>
        {
            if call.args.len() != 1 {
                errs.push(
                    call.paren_token.span.join(),
                    "`wait` takes one duration: `in_progress = wait(\"10s\")`",
                );
                return None;
            }
            parse_duration_lit(&call.args[0], Kind::Wait, "wait", errs).map(InProgress::Wait)
        }
        _ => {
            errs.push(span_of(expr), HELP);
            None
        }
    }
}

fn parse_errors(expr: &Expr, errs: &mut Errs) -> Option<Errors> {
    const HELP: &str = "`errors` is `release` (an Err frees the key; the default), `record` \
                        (an Err is recorded and replayed) or `record_if(path::to::predicate)` \
                        (record the errors for which `predicate(&e)` is true)";
    match ungroup(expr) {
        Expr::Path(p) if p.path.is_ident("release") => Some(Errors::Release),
        Expr::Path(p) if p.path.is_ident("record") => Some(Errors::Record),
        Expr::Call(call) if matches!(ungroup(&call.func), Expr::Path(p) if p.path.is_ident("record_if")) => {
            match (call.args.len(), call.args.first().map(ungroup)) {
                (1, Some(Expr::Path(p))) if p.qself.is_none() => {
                    Some(Errors::RecordIf(p.path.clone()))
                }
                _ => {
                    errs.push(
                        call.paren_token.span.join(),
                        "`record_if` takes the path of a function `fn(&E) -> bool`, e.g. \
                         `errors = record_if(ChargeError::is_final)`",
                    );
                    None
                }
            }
        }
        _ => {
            errs.push(span_of(expr), HELP);
            None
        }
    }
}

/// A path as written, without spaces: `ChargeError::is_final`.
pub(crate) fn path_text(path: &Path) -> String {
    let mut out = String::new();
    if path.leading_colon.is_some() {
        out.push_str("::");
    }
    for (i, seg) in path.segments.iter().enumerate() {
        if i > 0 {
            out.push_str("::");
        }
        out.push_str(&seg.ident.to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    fn check_err(attr: TokenStream, func: TokenStream) -> String {
        match check(attr, func) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e,
        }
    }

    fn check(attr: TokenStream, func: TokenStream) -> Result<Spec, String> {
        let raw: RawArgs = syn::parse2(attr).map_err(|e| e.to_string())?;
        let func: ItemFn = syn::parse2(func).map_err(|e| e.to_string())?;
        validate(raw, &func, Span::call_site()).map_err(|e| {
            e.into_iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        })
    }

    fn charge() -> TokenStream {
        quote!(
            async fn charge(
                account: &Account,
                key: &str,
                req: &Req,
                note: String,
            ) -> Result<u8, E> {
                todo!()
            }
        )
    }

    fn names(spec: &Spec) -> Vec<String> {
        spec.fingerprinted.iter().map(|i| i.to_string()).collect()
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
        assert!(spec.ttl.is_none() && spec.lease.is_none());
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
        for expected in [
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
        ] {
            assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
        }
    }

    #[test]
    fn combinations_are_checked() {
        let err = check_err(
            quote!(
                scope = "a",
                key = key,
                tenant = shared,
                tx = conn,
                store = s
            ),
            quote!(
                async fn f(conn: &mut C, s: &S, key: &str) -> Result<u8, E> {
                    todo!()
                }
            ),
        );
        assert!(err.contains("cannot be used together"), "{err}");
        let err = check_err(
            quote!(
                scope = "a",
                key = key,
                tenant = shared,
                fingerprint = false,
                skip(s)
            ),
            quote!(
                async fn f(s: &S, key: &str) -> Result<u8, E> {
                    todo!()
                }
            ),
        );
        assert!(err.contains("no effect"), "{err}");
        let err = check_err(
            quote!(scope = "a", key = key, tenant = shared, tx = nothere),
            quote!(
                async fn f(key: &str) -> Result<u8, E> {
                    todo!()
                }
            ),
        );
        assert!(err.contains("`tx` must name a parameter"), "{err}");
    }

    #[test]
    fn only_bare_shared_opts_out() {
        let f = quote!(
            async fn f(shared: &str, key: &str, n: u8) -> Result<u8, E> {
                todo!()
            }
        );
        // The bare word with a parameter called `shared` means two things: refused.
        let err = check_err(quote!(scope = "a", key = key, tenant = shared), f.clone());
        assert!(err.contains("write `tenant = (shared)`"), "{err}");
        let spec = check(
            quote!(scope = "a", key = key, tenant = shared),
            quote!(
                async fn f(key: &str, n: u8) -> Result<u8, E> {
                    todo!()
                }
            ),
        )
        .unwrap();
        assert!(matches!(spec.tenant, Tenant::Shared));
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
        let f = quote!(
            async fn f(conn: &mut C, tenant: &str, key: &str, note: &str, n: u8) -> Result<u8, E> {
                todo!()
            }
        );
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
        assert_eq!(spec.ttl, Some(Duration::from_secs(3600)));
        assert_eq!(spec.lease, Some(Duration::from_secs(2)));
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
            matches!(spec.tenant, Tenant::Shared),
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
        for expected in [
            "uppercase",
            "`ttl` must be longer than zero",
            "`fingerprint` is `true` or `false`",
            "`tx` must name a parameter",
        ] {
            assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
        }
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
        let spec = check(
            quote!(
                scope = "a",
                key = key,
                tenant = shared,
                recover = Self::charge_happened,
                shared_scope
            ),
            quote!(
                async fn f(&self, key: &str) -> Result<u8, E> {
                    todo!()
                }
            ),
        )
        .unwrap();
        assert!(spec.shared_scope);
        assert_eq!(
            spec.recover.as_ref().map(path_text).as_deref(),
            Some("Self::charge_happened")
        );
        let spec = check(
            quote!(scope = "a", key = key, tenant = shared),
            quote!(
                async fn f(key: &str) -> Result<u8, E> {
                    todo!()
                }
            ),
        )
        .unwrap();
        assert!(!spec.shared_scope && spec.recover.is_none());
        let err = check_err(
            quote!(
                scope = "a",
                key = key,
                tenant = shared,
                recover = 1 + 2,
                shared_scope = yes
            ),
            quote!(
                async fn f(key: &str) -> Result<u8, E> {
                    todo!()
                }
            ),
        );
        assert!(
            err.contains("`recover` takes the path of an `async fn"),
            "{err}"
        );
        assert!(err.contains("`shared_scope` is a flag"), "{err}");
    }

    #[test]
    fn policies_and_durations() {
        let spec = check(
            quote!(
                scope = "a",
                key = key,
                tenant = shared,
                in_progress = reject,
                errors = record_if(E::is_final),
                ttl = "1h",
                lease = "2s",
                crate = ::rt
            ),
            quote!(
                async fn f(&self, key: &str) -> anyhow::Result<u8> {
                    todo!()
                }
            ),
        )
        .unwrap();
        assert!(matches!(spec.in_progress, InProgress::Reject));
        assert!(matches!(&spec.errors, Errors::RecordIf(p) if path_text(p) == "E::is_final"));
        assert_eq!(spec.ttl, Some(Duration::from_secs(3600)));
        assert_eq!(spec.lease, Some(Duration::from_secs(2)));
        assert_eq!(spec.krate.to_string(), ":: rt");
        assert!(spec.fingerprinted.is_empty());
    }
}
