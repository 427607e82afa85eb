//! The attribute's arguments, syntax only: each argument is read on its own
//! (its name, its shape, its value: a scope literal's format, a duration, a
//! policy) and every mistake goes into the [`Ctxt`]. Nothing here looks at the
//! function or at other arguments; that is [`crate::check`].
//!
//! An argument passed through a `macro_rules!` metavariable (`scope = $s` with
//! `$s:literal`, `key = $k` with `$k:expr`, `$p:path`, `$t:ty`) arrives wrapped
//! in an invisible (`Delimiter::None`) group, which syn parses as
//! `Expr::Group`. Every check of an argument's shape goes through [`ungroup`]
//! first, so such an argument behaves exactly as if written directly, and
//! messages are spanned at the user's token inside the group (the group's own
//! span is the `$s` in the macro's definition). Identifiers inside a group
//! (`skip($a)`, an argument's name) are seen through by syn's cursor itself.

use crate::ctxt::Ctxt;
use idempotent_rules::duration::{parse_duration, DurationKind, DEFAULT_WAIT};
use idempotent_rules::scope::{nearest, scope_problems};
use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use std::time::Duration;
use syn::ext::IdentExt;
use syn::parse::{ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Expr, ExprLit, Ident, Lit, LitStr, Path, Token};

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

/// `tenant = <expr> | shared`.
pub(crate) enum Tenant {
    Expr(Expr),
    /// The opt-out, with the span of the word `shared`.
    Shared(Span),
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

/// The arguments as written, each checked on its own. A value that was
/// refused is `None` (its error is in the `Ctxt`).
pub(crate) struct Attr {
    /// The scope literal, and whether its format is valid.
    pub scope: Option<(LitStr, bool)>,
    pub key: Option<Expr>,
    pub tenant: Option<Tenant>,
    pub store: Option<Expr>,
    /// The `tx = ...` expression; [`crate::check`] checks it names a parameter.
    pub tx: Option<Expr>,
    /// `skip` with its names.
    pub skip: Option<(Ident, Vec<Ident>)>,
    /// `fingerprint` with its value.
    pub fingerprint: Option<(Ident, bool)>,
    pub ttl: Option<Duration>,
    pub lease: Option<Duration>,
    pub in_progress: InProgress,
    pub errors: Errors,
    pub recover: Option<Recover>,
    pub shared_scope: bool,
    pub krate: Option<TokenStream>,
}

/// `recover = ...`: the hook asked before a takeover re-runs the body.
#[derive(Clone)]
pub enum Recover {
    /// `recover = path::to::hook`: called as `hook(&takeover)`.
    Function(Path),
    /// `recover = self.hook`: called as `self.hook(&takeover)`, on a method
    /// taking `&self` (the hook reaches the same state as the body, e.g. a
    /// gateway client held by the service). `receiver` is the method's own
    /// `self` (set by the checks), so the call resolves with its hygiene.
    Method {
        method: Ident,
        receiver: Option<Token![self]>,
    },
}

impl Recover {
    /// The hook as written, for the registry.
    pub fn text(&self) -> String {
        match self {
            Recover::Function(path) => path_text(path),
            Recover::Method { method, .. } => format!("self.{method}"),
        }
    }
}

/// One argument as written.
struct RawArg {
    name: Ident,
    value: RawValue,
}

enum RawValue {
    /// `name`
    Bare,
    /// `name = expr`
    Eq(Expr),
    /// `name(...)`
    List(TokenStream),
}

/// Reads `name = expr`, `name(...)` and bare `name`s separated by commas; on a
/// syntax error, keeps what came before it and reports the error.
fn raw_args(cx: &Ctxt, tokens: TokenStream) -> (Vec<RawArg>, bool) {
    let mut args = Vec::new();
    let parser = |input: ParseStream| -> syn::Result<()> {
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
        Ok(())
    };
    match parser.parse2(tokens) {
        Ok(()) => (args, true),
        Err(e) => {
            cx.syn_error(e);
            (args, false)
        }
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
pub(crate) fn span_of(expr: &Expr) -> Span {
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

fn duration_lit(cx: &Ctxt, expr: &Expr, kind: DurationKind, name: &str) -> Option<Duration> {
    let Some(lit) = lit_str(expr) else {
        // How the argument is written: `ttl = "30s"`, but `wait("30s")`.
        let example = match kind {
            DurationKind::Wait => format!("`in_progress = {name}(\"30s\")`"),
            _ => format!("`{name} = \"30s\"`"),
        };
        cx.error_spanned(
            ungroup(expr),
            format!("`{name}` takes a duration in a string literal, e.g. {example}"),
        );
        return None;
    };
    match parse_duration(&lit.value(), kind) {
        Ok(d) => Some(d),
        Err(e) => {
            cx.error(lit.span(), e);
            None
        }
    }
}

/// Reads the attribute. Every mistake is recorded in `cx`.
pub(crate) fn parse(cx: &Ctxt, tokens: TokenStream, span: Span) -> Attr {
    let (raw, complete) = raw_args(cx, tokens);
    let mut attr = Attr {
        scope: None,
        key: None,
        tenant: None,
        store: None,
        tx: None,
        skip: None,
        fingerprint: None,
        ttl: None,
        lease: None,
        in_progress: InProgress::Wait(DEFAULT_WAIT),
        errors: Errors::Release,
        recover: None,
        shared_scope: false,
        krate: None,
    };
    let mut seen: Vec<String> = Vec::new();
    for RawArg { name, value } in raw {
        let n = name.unraw().to_string();
        if !KNOWN.contains(&n.as_str()) {
            let hint = nearest(&n, KNOWN.iter().copied(), Some(3))
                .map(|s| format!("did you mean `{s}`? "))
                .unwrap_or_default();
            cx.error(
                name.span(),
                format!(
                    "unknown argument `{n}`; {hint}#[idempotent] accepts: {}",
                    KNOWN.join(", ")
                ),
            );
            continue;
        }
        if seen.contains(&n) {
            cx.error(
                name.span(),
                format!("`{n}` is given more than once; keep one"),
            );
            continue;
        }
        seen.push(n.clone());
        let expr = match (n.as_str(), value) {
            ("skip", RawValue::List(tokens)) => {
                let parser = Punctuated::<Expr, Token![,]>::parse_terminated;
                match parser.parse2(tokens) {
                    // Every entry that is not a name is reported, each at itself.
                    Ok(entries) => {
                        let names = entries
                            .iter()
                            .filter_map(|entry| skipped_name(cx, entry))
                            .collect();
                        attr.skip = Some((name, names));
                    }
                    Err(e) => cx.error(e.span(), "`skip` lists parameter names: `skip(a, b)`"),
                }
                continue;
            }
            ("skip", _) => {
                cx.error(
                    name.span(),
                    "`skip` lists parameter names in parentheses: `skip(a, b)`",
                );
                continue;
            }
            ("shared_scope", RawValue::Bare) => {
                attr.shared_scope = true;
                continue;
            }
            ("shared_scope", _) => {
                cx.error(
                    name.span(),
                    "`shared_scope` is a flag and takes no value: write `shared_scope` alone, on \
                     every function that claims the scope on purpose",
                );
                continue;
            }
            (_, RawValue::Eq(expr)) => expr,
            (_, RawValue::Bare) => {
                cx.error(
                    name.span(),
                    format!("`{n}` needs a value: {}", example_for(&n)),
                );
                continue;
            }
            // `ttl("24h")`: a value given the way `skip(...)` takes its list.
            (_, RawValue::List(_)) => {
                cx.error(
                    name.span(),
                    format!(
                        "`{n}` takes its value after `=`, not in parentheses: {}",
                        example_for(&n)
                    ),
                );
                continue;
            }
        };
        match n.as_str() {
            "scope" => match lit_str(&expr) {
                Some(lit) => {
                    // Every rule the scope breaks, not only the first.
                    let problems = scope_problems(&lit.value());
                    for problem in &problems {
                        cx.error(lit.span(), problem);
                    }
                    attr.scope = Some((lit.clone(), problems.is_empty()));
                }
                None => cx.error_spanned(
                    ungroup(&expr),
                    "`scope` must be a string literal, e.g. `scope = \"payments.charge\"`; \
                     the scope is checked when the code compiles, so it cannot be computed",
                ),
            },
            "key" => attr.key = Some(expr),
            "tenant" => {
                attr.tenant = Some(if is_shared_opt_out(&expr) {
                    Tenant::Shared(span_of(&expr))
                } else {
                    Tenant::Expr(expr)
                })
            }
            "store" => attr.store = Some(expr),
            "tx" => attr.tx = Some(expr),
            "fingerprint" => match ungroup(&expr) {
                Expr::Lit(ExprLit {
                    lit: Lit::Bool(b), ..
                }) => attr.fingerprint = Some((name, b.value)),
                _ => cx.error_spanned(
                    ungroup(&expr),
                    "`fingerprint` is `true` or `false`: `fingerprint = false` turns the \
                     fingerprint off",
                ),
            },
            "ttl" => attr.ttl = duration_lit(cx, &expr, DurationKind::Ttl, "ttl"),
            "lease" => attr.lease = duration_lit(cx, &expr, DurationKind::Lease, "lease"),
            "in_progress" => {
                if let Some(p) = in_progress(cx, &expr) {
                    attr.in_progress = p
                }
            }
            "errors" => {
                if let Some(e) = errors(cx, &expr) {
                    attr.errors = e
                }
            }
            "recover" => match ungroup(&expr) {
                Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => {
                    attr.recover = Some(Recover::Function(p.path.clone()))
                }
                Expr::Field(f)
                    if f.attrs.is_empty()
                        && matches!(ungroup(&f.base), Expr::Path(b) if b.qself.is_none() && b.path.is_ident("self")) =>
                {
                    match &f.member {
                        syn::Member::Named(method) => {
                            attr.recover = Some(Recover::Method {
                                method: method.clone(),
                                receiver: None,
                            })
                        }
                        syn::Member::Unnamed(_) => cx.error_spanned(
                            ungroup(&expr),
                            "`recover = self.<method>` names a method taking `&self`, e.g. \
                             `recover = self.charge_happened`",
                        ),
                    }
                }
                _ => cx.error_spanned(
                    ungroup(&expr),
                    "`recover` takes the path of an `async fn(&idempotent_runtime::Takeover) -> \
                     Result<idempotent_runtime::Recovery<T>, E>` (T and E this function's), e.g. \
                     `recover = charge_happened`, or `self.<method>` for such a method taking \
                     `&self`",
                ),
            },
            "crate" => match ungroup(&expr) {
                Expr::Path(p) if p.qself.is_none() => attr.krate = Some(p.path.to_token_stream()),
                _ => cx.error_spanned(
                    ungroup(&expr),
                    "`crate` takes the path of the runtime crate, e.g. `crate = ::my_idempotent`",
                ),
            },
            _ => unreachable!("every name in KNOWN is handled"),
        }
    }
    // Required arguments, spanned at the whole attribute. After a syntax
    // error (`complete` is false) the rest of the attribute is unknown: do not guess.
    if complete {
        for name in ["scope", "key", "tenant"] {
            if !seen.iter().any(|s| s == name) {
                cx.error(span, format!("missing `{name}`: {}", example_for(name)));
            }
        }
    }
    attr
}

/// One entry of `skip(...)`: a parameter's name (possibly passed through a
/// metavariable, or in parentheses). Anything else is reported at the entry;
/// a part of a parameter (`req.trace_id`) names the parameter to skip instead,
/// as a parameter is fingerprinted whole.
fn skipped_name(cx: &Ctxt, entry: &Expr) -> Option<Ident> {
    if let Some(name) = plain_ident(entry) {
        return Some(name.clone());
    }
    let mut base = ungroup(entry);
    loop {
        base = match base {
            Expr::Field(f) => ungroup(&f.base),
            Expr::Index(i) => ungroup(&i.expr),
            Expr::MethodCall(m) => ungroup(&m.receiver),
            Expr::Paren(p) => ungroup(&p.expr),
            _ => break,
        }
    }
    let message = match plain_ident(base) {
        Some(parameter) if !std::ptr::eq(base, ungroup(entry)) => format!(
            "`skip` lists parameter names, not parts of them: a parameter is fingerprinted \
             whole, so leave out all of `{parameter}` with `skip({parameter})`, or keep it"
        ),
        _ => "`skip` lists parameter names: `skip(a, b)`".to_owned(),
    };
    cx.error_spanned(ungroup(entry), message);
    None
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
        "recover" => "`recover = path::to::hook` (or `self.hook`, a method taking `&self`), an `async fn(&Takeover) -> Result<Recovery<T>, E>` asked before a takeover re-runs the body",
        "shared_scope" => "`shared_scope` (a flag, no value)",
        "crate" => "`crate = ::path::to::idempotent_runtime`",
        _ => "see the #[idempotent] documentation",
    }
}

fn in_progress(cx: &Ctxt, expr: &Expr) -> Option<InProgress> {
    const HELP: &str =
        "`in_progress` is `wait(\"10s\")` (wait up to that long for the first call's result) \
         or `reject` (refuse a concurrent duplicate at once)";
    match ungroup(expr) {
        Expr::Path(p) if p.path.is_ident("reject") => Some(InProgress::Reject),
        Expr::Path(p) if p.path.is_ident("wait") => {
            cx.error_spanned(
                ungroup(expr),
                "`wait` needs a duration: `in_progress = wait(\"10s\")`",
            );
            None
        }
        Expr::Call(call) if matches!(ungroup(&call.func), Expr::Path(p) if p.path.is_ident("wait")) =>
        {
            if call.args.len() != 1 {
                cx.error(
                    call.paren_token.span.join(),
                    "`wait` takes one duration: `in_progress = wait(\"10s\")`",
                );
                return None;
            }
            duration_lit(cx, &call.args[0], DurationKind::Wait, "wait").map(InProgress::Wait)
        }
        _ => {
            cx.error_spanned(ungroup(expr), HELP);
            None
        }
    }
}

fn errors(cx: &Ctxt, expr: &Expr) -> Option<Errors> {
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
                    cx.error(
                        call.paren_token.span.join(),
                        "`record_if` takes the path of a function `fn(&E) -> bool`, e.g. \
                         `errors = record_if(ChargeError::is_final)`",
                    );
                    None
                }
            }
        }
        _ => {
            cx.error_spanned(ungroup(expr), HELP);
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
