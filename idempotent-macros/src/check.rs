//! Checks across arguments and against the function, after [`crate::attr`]
//! has read each argument on its own: the function's shape, `key`/`tenant`/
//! `skip`/`tx` against the parameters, `tx` with `store`, `fingerprint =
//! false` with `skip`, the scope manifest (membership, retirement, defaults)
//! and the one-function-per-scope rule (`shared_scope`). Every mistake goes
//! into the same [`Ctxt`] as the argument errors, so all are reported in one
//! round.

use crate::attr::{self, Attr, Errors, InProgress, Tenant};
use crate::claims;
use crate::ctxt::Ctxt;
use crate::item::MaybeItemFn;
use idempotent_rules::duration::{DEFAULT_LEASE, DEFAULT_TTL};
use idempotent_rules::manifest::{self, Manifest, ManifestError};
use idempotent_rules::scope::nearest;
use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use std::path::PathBuf;
use std::time::Duration;
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{Expr, FnArg, Ident, LitStr, Pat, ReturnType, Signature, Type};

/// A parameter's name as Rust reads it: `r#amount` is `amount`. What the
/// fingerprint and the registry name it by, so a raw spelling (which
/// `cargo fix` writes for a name that became a keyword) changes nothing.
pub(crate) fn name_text(name: &Ident) -> String {
    name.unraw().to_string()
}

/// Whether two identifiers name the same thing, raw or not.
fn same_name(a: &Ident, b: &Ident) -> bool {
    a.unraw() == b.unraw()
}

/// Everything the attribute and the function declare, checked: what
/// [`crate::expand`] generates code from.
pub(crate) struct Spec {
    pub scope: LitStr,
    pub key: Expr,
    pub tenant: Tenant,
    pub store: Option<Expr>,
    pub tx: Option<Ident>,
    pub fingerprint: bool,
    /// The attribute's `ttl`, else the manifest's, else 24h.
    pub ttl: Duration,
    /// The attribute's `lease`, else the manifest's, else 30s.
    pub lease: Duration,
    pub in_progress: InProgress,
    pub errors: Errors,
    /// `recover = ...`: asked before a takeover re-runs the body (rule 20).
    pub recover: Option<crate::attr::Recover>,
    /// `shared_scope`: the scope is claimed by several functions on purpose (rule 21).
    pub shared_scope: bool,
    pub krate: TokenStream,
    /// The parameters that go into the fingerprint, in declaration order.
    pub fingerprinted: Vec<Fingerprinted>,
    /// The manifest file, so the generated code can make cargo rebuild when it changes.
    pub manifest: Option<PathBuf>,
}

/// What the checks need from outside the attribute: the scope manifest and
/// where this function's claim on its scope is recorded. Built from the
/// compiler's environment by [`Env::from_compiler`]; tests build their own.
pub(crate) struct Env {
    /// `None`: no manifest (only the format is checked). `Some(Err)`: it could
    /// not be found (`IDEMPOTENT_MANIFEST` names nothing) or read, or breaks the rules.
    pub manifest: Option<Result<Manifest, ManifestError>>,
    /// The manifest's path, when one was found.
    pub manifest_path: Option<PathBuf>,
    /// Where to record the claim (crate, file, line); `None`: not checked.
    pub claim: Option<ClaimPlace>,
}

/// The crate being compiled and where the function is.
pub(crate) struct ClaimPlace {
    pub krate: String,
    pub file: String,
    pub line: usize,
}

impl Env {
    /// The manifest found by the one lookup order (`idempotent_rules::manifest::locate`,
    /// from the crate's directory), and the claim place when the compiler gives it.
    pub fn from_compiler(item: &MaybeItemFn) -> Env {
        let crate_dir = std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from);
        let (manifest, manifest_path) = match manifest::locate(crate_dir.as_deref()) {
            Err(e) => (Some(Err(e)), None),
            Ok(None) => (None, None),
            Ok(Some(path)) => (Some(Manifest::load(&path)), Some(path)),
        };
        // A function under `#[cfg]` may have a twin under the opposite cfg claiming
        // the same scope; only claim functions that are certainly compiled.
        let has_cfg = item.outer_attrs.iter().any(|a| a.path().is_ident("cfg"));
        // Without cargo's crate name (a tool expanding outside cargo) claims from
        // different crates could not be told apart; skip rather than misreport.
        let in_cargo = std::env::var_os("CARGO_CRATE_NAME").is_some();
        let claim = (proc_macro::is_available() && !has_cfg && in_cargo).then(|| {
            let span = item.sig.ident.span().unwrap();
            ClaimPlace {
                krate: claims::current_crate(),
                file: span.file(),
                line: span.line(),
            }
        });
        Env {
            manifest,
            manifest_path,
            claim,
        }
    }

    /// No manifest, no claims.
    #[cfg(test)]
    pub fn none() -> Env {
        Env {
            manifest: None,
            manifest_path: None,
            claim: None,
        }
    }
}

/// The macro's validation entry point: reads the attribute and checks it
/// against the function and `env`. Every mistake is reported, in one round.
pub(crate) fn validate(
    attr_tokens: TokenStream,
    attr_span: Span,
    item: &MaybeItemFn,
    env: &Env,
) -> Result<Spec, syn::Error> {
    let cx = Ctxt::new();
    signature(&cx, &item.sig);
    applied_once(&cx, &item.outer_attrs);
    let attr = attr::parse(&cx, attr_tokens, attr_span);
    store_not_borrowed_from_an_owned_self(&cx, attr.store.as_ref(), &item.sig, &item.body);
    let spec = cross(&cx, attr, &item.sig, env);
    cx.check()?;
    spec.ok_or_else(|| syn::Error::new(attr_span, "missing `scope`, `key` or `tenant`"))
}

/// `store = self.store` borrows the store from `self` for the whole call,
/// while the body, an `async move` block, takes whatever part of `self` it
/// uses. A method that owns `self` (by value, or `self: Arc<Self>` and the
/// like) and whose body uses the part the store is borrowed from (for a
/// smart pointer, any use: a field is reached through its `Deref`, so the
/// body takes the pointer whole) cannot compile; rustc's own error is
/// E0505 "cannot move out of `self` because it is borrowed", pointed at the
/// whole attribute. Said here instead, at `store = ...`, with the way out.
/// Only what surely fails is refused: a body using other fields of a
/// by-value `self` compiles (edition 2021 captures fields apart).
fn store_not_borrowed_from_an_owned_self(
    cx: &Ctxt,
    store: Option<&Expr>,
    sig: &Signature,
    body: &TokenStream,
) {
    let (Some(store), Some(receiver)) = (store, sig.receiver()) else {
        return;
    };
    if receiver.reference.is_some() || shared_borrow(receiver) || pinned_borrow(receiver) {
        return;
    }
    let Some(store_path) = place_in_self(store) else {
        return;
    };
    // `self`, `self: Self` or `self: Ledger` (the type by its name): fields
    // are captured apart; a pointer (`Arc<Self>`, `Box<Self>`,
    // `Pin<Box<Self>>`, `&mut Self`) owns `self` whole.
    let by_value = match receiver.colon_token {
        None => true,
        Some(_) => !through_a_pointer(&receiver.ty),
    };
    let mut uses = Vec::new();
    self_uses(body.clone(), &mut uses);
    let conflicts = uses.iter().any(|(used, matched)| {
        // A by-value `self` matched against a pattern (`let Self { amount,
        // .. } = self`, `match self { ... }`) moves only the fields the
        // pattern binds: not surely the store's.
        if by_value && *matched {
            return false;
        }
        !by_value
            || used.len() <= store_path.len() && store_path[..used.len()] == used[..]
            || store_path.len() <= used.len() && used[..store_path.len()] == store_path[..]
    });
    if !conflicts {
        return;
    }
    let shown = |tokens: TokenStream| {
        tokens
            .to_string()
            .replace(" . ", ".")
            .replace(" :: ", "::")
            .replace(" < ", "<")
            .replace(" >", ">")
            .replace("& ", "&")
    };
    let takes = match receiver.colon_token {
        Some(_) => format!("`self: {}`", shown(receiver.ty.to_token_stream())),
        None => "`self` by value".to_owned(),
    };
    let store_text = shown(attr::ungroup(store).to_token_stream());
    cx.error_spanned(
        attr::ungroup(store),
        format!(
            "`store = {store_text}` borrows the store from `self` for the whole call, but this \
             method takes {takes} and its body uses it, which moves `self` into the body while \
             the store is borrowed from it (rustc: E0505, cannot move out of `self`); write \
             `store = {store_text}.clone()` (a clone of a store, or of an `Arc` of one, is a \
             handle on the same records), or take `&self`"
        ),
    );
}

/// Whether a receiver's type reaches `Self` through a pointer: a reference,
/// a `Box`, `Rc`, `Arc` or `Pin`, or any type with `Self` among its generic
/// arguments (`MyPtr<Self>`). A type named as itself (`self: Ledger`,
/// `self: Ledger<T>`) is `self` by value.
fn through_a_pointer(ty: &Type) -> bool {
    fn mentions_self(ty: &Type) -> bool {
        ty.to_token_stream()
            .into_iter()
            .any(|t| matches!(t, proc_macro2::TokenTree::Ident(id) if id == "Self"))
    }
    match ungroup_type(ty) {
        Type::Paren(p) => through_a_pointer(&p.elem),
        Type::Path(p) if p.qself.is_none() => p.path.segments.last().is_some_and(|last| {
            ["Box", "Rc", "Arc", "Pin"]
                .iter()
                .any(|name| last.ident == name)
                || matches!(&last.arguments, syn::PathArguments::AngleBracketed(a)
                        if a.args.iter().any(|arg| matches!(arg,
                            syn::GenericArgument::Type(t) if mentions_self(t))))
        }),
        // A reference, or a type not written as a plain path: not by value.
        _ => true,
    }
}

/// `self: Pin<&Self>` or `self: Pin<&mut Self>`: a borrow, not an owner.
fn pinned_borrow(r: &syn::Receiver) -> bool {
    r.colon_token.is_some()
        && matches!(ungroup_type(&r.ty), Type::Path(p) if p.qself.is_none()
            && p.path.segments.last().is_some_and(|last| last.ident == "Pin"
                && matches!(&last.arguments, syn::PathArguments::AngleBracketed(a)
                    if a.args.iter().any(|arg| matches!(arg,
                        syn::GenericArgument::Type(t) if matches!(ungroup_type(t), Type::Reference(_)))))))
}

/// The fields of `self` a `store` expression is a place in (`self.a.b`,
/// `(self.a)`, `&self.a`): `Some(["a", "b"])`; `None` when it is not a place
/// in `self` (a method call's value, `self.store.clone()`, is the call's own).
fn place_in_self(expr: &Expr) -> Option<Vec<String>> {
    match attr::ungroup(expr) {
        Expr::Paren(p) => place_in_self(&p.expr),
        Expr::Reference(r) => place_in_self(&r.expr),
        Expr::Path(p) if p.qself.is_none() && p.path.is_ident("self") => Some(Vec::new()),
        Expr::Field(f) => {
            let mut path = place_in_self(&f.base)?;
            path.push(match &f.member {
                syn::Member::Named(name) => name.unraw().to_string(),
                syn::Member::Unnamed(index) => index.index.to_string(),
            });
            Some(path)
        }
        _ => None,
    }
}

/// Every use of `self` in the body's tokens, as the fields it goes through
/// (`self.a.b.len()` → `["a", "b"]`; `&self`, `self.method()` → `[]`).
/// `self::path` is a path, not a use; nested items (`fn`, `impl`, `trait`,
/// `mod`) have a `self` of their own and are not looked into, and a `use`
/// declaration's `self` (`use std::fmt::{self, Write};`) is a module's.
/// Each use comes with whether it is a bare `self` matched against a
/// pattern: right after `match`, or after a lone `=` (`let P = self`,
/// `if let P = self`), not `==`, `<=` or `+=`.
fn self_uses(tokens: TokenStream, uses: &mut Vec<(Vec<String>, bool)>) {
    use proc_macro2::TokenTree;
    let tokens: Vec<TokenTree> = tokens.into_iter().collect();
    let punct =
        |i: usize, c: char| matches!(tokens.get(i), Some(TokenTree::Punct(p)) if p.as_char() == c);
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            TokenTree::Ident(id)
                if ["fn", "impl", "trait", "mod"].contains(&id.to_string().as_str()) =>
            {
                // Up to and over the item's braces.
                while i < tokens.len()
                    && !matches!(&tokens[i], TokenTree::Group(g) if g.delimiter() == proc_macro2::Delimiter::Brace)
                {
                    i += 1;
                }
            }
            TokenTree::Ident(id) if id == "use" => {
                // Up to the declaration's `;` (its `{...}` is one group).
                while i < tokens.len() && !punct(i, ';') {
                    i += 1;
                }
            }
            TokenTree::Ident(id) if id == "self" && !(punct(i + 1, ':') && punct(i + 2, ':')) => {
                let mut path = Vec::new();
                let mut j = i + 1;
                while punct(j, '.') {
                    let field = match tokens.get(j + 1) {
                        Some(TokenTree::Ident(f)) => f.unraw().to_string(),
                        Some(TokenTree::Literal(l)) => l.to_string(),
                        _ => break,
                    };
                    // A method call (or turbofish) uses the place before it.
                    if matches!(tokens.get(j + 2), Some(TokenTree::Group(g)) if g.delimiter() == proc_macro2::Delimiter::Parenthesis)
                        || (punct(j + 2, ':') && punct(j + 3, ':'))
                    {
                        break;
                    }
                    path.extend(field.split('.').map(str::to_owned));
                    j += 2;
                }
                let matched = path.is_empty()
                    && match i.checked_sub(1).map(|b| &tokens[b]) {
                        Some(TokenTree::Ident(before)) => before == "match",
                        Some(TokenTree::Punct(eq)) if eq.as_char() == '=' => !matches!(
                            i.checked_sub(2).map(|b| &tokens[b]),
                            Some(TokenTree::Punct(p)) if p.spacing() == proc_macro2::Spacing::Joint
                        ),
                        _ => false,
                    };
                uses.push((path, matched));
            }
            TokenTree::Group(g) => self_uses(g.stream(), uses),
            _ => {}
        }
        i += 1;
    }
}

/// A parameter that goes into the fingerprint.
pub(crate) struct Fingerprinted {
    pub name: Ident,
    /// Its `#[cfg]`s: it is fingerprinted (and listed) only where it is
    /// compiled in.
    pub cfgs: Vec<TokenStream>,
    /// A by-value `self`: fingerprinted since builds that left it out, so a
    /// record they stored is compared without it too (legacy form).
    pub receiver: bool,
}

/// A parameter of the annotated function, as far as the fingerprint cares.
struct Param {
    /// `None` for a pattern (`(a, b): (u8, u8)`, `_`).
    name: Option<Ident>,
    /// Its `#[cfg]`s (see [`crate::item::cfgs_of`]).
    cfgs: Vec<TokenStream>,

    /// Where to point at in messages.
    span: Span,
    is_self: bool,
    /// `self`, `mut self` or `self: Self`: the method consumes the value,
    /// which is then the request (a command object), not a service.
    by_value_self: bool,
    /// `_: T`
    is_wildcard: bool,
}

/// A receiver both a `recover = self.hook` call and the body can use: a
/// shared borrow (`&self`, `self: &Self`, `self: &Arc<Self>`) or a pinned one
/// (`self: Pin<&Self>`).
fn shared_borrow(r: &syn::Receiver) -> bool {
    fn shared_ref(ty: &Type) -> bool {
        match ty {
            Type::Reference(reference) => reference.mutability.is_none(),
            Type::Group(g) => shared_ref(&g.elem),
            Type::Paren(p) => shared_ref(&p.elem),
            Type::Path(p) => p.qself.is_none()
                && p.path.segments.last().is_some_and(|last| {
                    last.ident == "Pin"
                        && matches!(&last.arguments, syn::PathArguments::AngleBracketed(a)
                            if a.args.len() == 1
                                && matches!(&a.args[0], syn::GenericArgument::Type(t) if shared_ref(t)))
                }),
            _ => false,
        }
    }
    match r.colon_token {
        // `self: T`: what T is.
        Some(_) => shared_ref(&r.ty),
        None => r.reference.is_some() && r.mutability.is_none(),
    }
}

fn params(sig: &Signature) -> Vec<Param> {
    sig.inputs
        .iter()
        .map(|input| match input {
            FnArg::Receiver(r) => Param {
                name: Some(Ident::new("self", r.self_token.span)),
                cfgs: Vec::new(),
                span: r.span(),
                is_self: true,
                by_value_self: r.reference.is_none()
                    && matches!(&*r.ty, Type::Path(p) if p.qself.is_none() && p.path.is_ident("Self")),
                is_wildcard: false,
            },
            FnArg::Typed(t) => match &*t.pat {
                // `req @ Req { amount, .. }` binds the whole value to a name too.
                Pat::Ident(p) => Param {
                    name: Some(p.ident.clone()),
                    cfgs: crate::item::cfgs_of(&t.attrs),
                    span: p.ident.span(),
                    is_self: p.ident == "self",
                    by_value_self: false,
                    is_wildcard: false,
                },
                other => Param {
                    name: None,
                    cfgs: Vec::new(),
                    span: other.span(),
                    is_self: false,
                    by_value_self: false,
                    is_wildcard: matches!(other, Pat::Wild(_)),
                },
            },
        })
        .collect()
}

fn param_list<'a>(params: impl IntoIterator<Item = &'a Param>) -> String {
    let names: Vec<String> = params
        .into_iter()
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

/// `ty` without the invisible groups around a `$t:ty` metavariable.
fn ungroup_type(mut ty: &Type) -> &Type {
    while let Type::Group(g) = ty {
        ty = &g.elem;
    }
    ty
}

/// Whether the return type may be a `Result<T, E>`: a path, unless it
/// names a type that is certainly something else. A type alias of any name
/// (`ChargeResult<T>`) is taken, and the compiler checks what it stands for
/// (the runtime's `IdempotentReturn`, which says so when it is not one).
fn returns_result(output: &ReturnType) -> bool {
    const CERTAINLY_NOT: &[&str] = &[
        "Option", "Vec", "String", "Box", "Arc", "Rc", "Cow", "Pin", "HashMap", "BTreeMap",
        "HashSet", "BTreeSet", "bool", "char", "str", "u8", "u16", "u32", "u64", "u128", "usize",
        "i8", "i16", "i32", "i64", "i128", "isize", "f32", "f64",
    ];
    let ReturnType::Type(_, ty) = output else {
        return false;
    };
    matches!(ungroup_type(ty), Type::Path(p) if p.qself.is_none()
        && p.path.segments.last().is_some_and(|s| !CERTAINLY_NOT.iter().any(|n| s.ident == n)))
}

/// The function itself: `async`, returning a `Result`.
/// A second `#[idempotent]` on the same function (the compiler hands this
/// one the item with the other still on it): each would reserve its own
/// record around the other, so one call held two keys, and a mismatch or a
/// replay came from whichever answered first.
fn applied_once(cx: &Ctxt, attrs: &[syn::Attribute]) {
    for attr in attrs {
        // `idempotent`, or a path to it through this project's crates (not
        // another crate's attribute of the same name).
        let segments = &attr.path().segments;
        let ours = segments.last().is_some_and(|s| s.ident == "idempotent")
            && (segments.len() == 1
                || segments.first().is_some_and(|s| {
                    s.ident == "idempotent_runtime" || s.ident == "idempotent_macros"
                }));
        if ours {
            cx.error(
                attr.path().span(),
                "#[idempotent] is written twice on this function: each would reserve a record \
                 of its own around the other; keep one (two code paths that share one \
                 deduplication boundary are two functions with `shared_scope`)",
            );
        }
    }
}

/// A method `#[async_trait]` rewrote before this attribute saw it: no
/// `async`, a boxed future (`Pin<Box<dyn Future<..> + Send + 'async_trait>>`)
/// as its return type.
fn rewritten_by_async_trait(sig: &Signature) -> bool {
    let ReturnType::Type(_, ty) = &sig.output else {
        return false;
    };
    let Type::Path(p) = ungroup_type(ty) else {
        return false;
    };
    // async-trait always adds its `'async_trait` lifetime: a boxed future
    // written by hand is "not async", not this.
    let has_async_trait_lifetime = sig
        .generics
        .lifetimes()
        .any(|l| l.lifetime.ident == "async_trait");
    sig.asyncness.is_none()
        && has_async_trait_lifetime
        && p.path.segments.last().is_some_and(|s| s.ident == "Pin")
}

/// The `impl Trait` among `Result<T, E>`'s arguments, if any: a replay
/// deserializes the recorded answer into `T` (and a recorded `E`), which
/// needs a type the function names.
fn impl_trait_in_result(output: &ReturnType) -> Option<Span> {
    /// The first `impl Trait` anywhere in a type (`Vec<impl Trait>` too).
    struct FirstImplTrait(Option<Span>);
    impl<'ast> syn::visit::Visit<'ast> for FirstImplTrait {
        fn visit_type_impl_trait(&mut self, found: &'ast syn::TypeImplTrait) {
            self.0.get_or_insert(found.span());
        }
    }
    let ReturnType::Type(_, ty) = output else {
        return None;
    };
    let mut first = FirstImplTrait(None);
    syn::visit::Visit::visit_type(&mut first, ty);
    first.0
}

/// The first `&str` or `&[T]` in the `Ok` type of a return type written
/// `Result<T, E>` (any path ending in `Result`: the first argument of
/// `io::Result<T>` and `anyhow::Result<T>` is the `Ok` type too): at the top,
/// or inside tuples, arrays (not `[T; 0]`), slices and the standard
/// containers (`Vec`, `Option`, `Box`, the maps and sets, named bare or by a
/// path from `std`, `alloc` or `core`). A replay decodes the recorded answer
/// into a new value, which borrows from nothing, and neither has an impl that
/// does that (nor can a crate write one); rustc's own error ("implementation
/// of `Deserialize` is not general enough") does not say so. Anything else
/// (a reference to a type of the crate's own, which may deserialize into an
/// interned value; a user type holding a reference; an associated type) is
/// left to the compiler.
fn borrowed_ok_type(output: &ReturnType) -> Option<&syn::TypeReference> {
    const CONTAINERS: &[&str] = &[
        "Vec", "VecDeque", "Option", "Box", "HashMap", "BTreeMap", "HashSet", "BTreeSet",
    ];
    fn never_owned(ty: &Type) -> Option<&syn::TypeReference> {
        match ungroup_type(ty) {
            Type::Reference(r) => match ungroup_type(&r.elem) {
                Type::Slice(_) => Some(r),
                Type::Path(p) if p.qself.is_none() && p.path.is_ident("str") => Some(r),
                _ => None,
            },
            Type::Paren(p) => never_owned(&p.elem),
            Type::Tuple(t) => t.elems.iter().find_map(never_owned),
            // `[T; 0]` serializes and deserializes whatever `T` is.
            Type::Array(a)
                if matches!(&a.len, syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Int(n), .. })
                    if n.base10_digits() == "0") =>
            {
                None
            }
            Type::Array(a) => never_owned(&a.elem),
            Type::Slice(s) => never_owned(&s.elem),
            Type::Path(p) if p.qself.is_none() => {
                // A standard container, named bare or by a path from `std`,
                // `alloc` or `core` (a crate's own `Vec` may deserialize
                // anything it likes).
                let segments = &p.path.segments;
                let from_std = segments.len() == 1
                    || segments.first().is_some_and(|s| {
                        s.ident == "std" || s.ident == "alloc" || s.ident == "core"
                    });
                let last = segments.last()?;
                if !from_std || !CONTAINERS.iter().any(|c| last.ident == c) {
                    return None;
                }
                let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
                    return None;
                };
                args.args.iter().find_map(|a| match a {
                    syn::GenericArgument::Type(t) => never_owned(t),
                    _ => None,
                })
            }
            _ => None,
        }
    }
    let ReturnType::Type(_, ty) = output else {
        return None;
    };
    let Type::Path(p) = ungroup_type(ty) else {
        return None;
    };
    if p.qself.is_some() {
        return None;
    }
    let last = p.path.segments.last().filter(|s| s.ident == "Result")?;
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    let ok = args.args.iter().find_map(|a| match a {
        syn::GenericArgument::Type(t) => Some(t),
        _ => None,
    })?;
    never_owned(ok)
}

fn signature(cx: &Ctxt, sig: &Signature) {
    if rewritten_by_async_trait(sig) {
        cx.error(
            sig.output.span(),
            "#[async_trait] rewrote this method into one returning a boxed future before \
             #[idempotent] saw it, so there is no `async fn` left to make idempotent; write \
             the `async fn` in the trait without #[async_trait] (Rust 1.75 and later), or put \
             #[idempotent] on an inherent method or a free function and call it from here",
        );
        return;
    }
    if let Some(span) = impl_trait_in_result(&sig.output) {
        cx.error(
            span,
            "`impl Trait` cannot be the result or error type of an #[idempotent] function: a \
             replay deserializes the recorded answer into that type, so it must be a named \
             type (Serialize + DeserializeOwned); name the type",
        );
    }
    if let Some(borrowed) = borrowed_ok_type(&sig.output) {
        cx.syn_error(syn::Error::new_spanned(
            borrowed,
            "a borrowed `&str` or `&[T]` cannot be in the result of an #[idempotent] function: \
             a replay decodes the recorded answer into a new value, which borrows from nothing; \
             return an owned type (`String` for `&str`, `Vec<T>` for `&[T]`, or \
             `Cow<'static, str>`); if the container is a type of your own named like a \
             standard one, write its path (`crate::...::Vec`)",
        ));
    }
    if sig.asyncness.is_none() {
        cx.error(
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
        cx.error(
            span,
            "#[idempotent] functions must return `Result<T, E>` (T: Serialize + Deserialize, \
             E: From<idempotent_runtime::Error>), or an alias of one, so a refusal or a store \
             failure can be returned as an error; change the return type",
        );
    }
}

/// Everything that involves more than one argument, the parameters, the
/// manifest or other functions. Returns the spec when every required
/// argument was readable (errors, if any, are in `cx`).
fn cross(cx: &Ctxt, attr: Attr, sig: &Signature, env: &Env) -> Option<Spec> {
    let params = params(sig);

    // `recover = self.hook` calls the hook on the same `self` as the body:
    // only a shared borrow can be used by both.
    let mut attr = attr;
    if let Some(crate::attr::Recover::Method { method, receiver }) = &mut attr.recover {
        match sig.receiver() {
            Some(r) if shared_borrow(r) => *receiver = Some(r.self_token),
            Some(r) => {
                let ty = &r.ty;
                let takes = match r.colon_token {
                    Some(_) => format!(
                        "`self: {}`",
                        quote::ToTokens::to_token_stream(ty)
                            .to_string()
                            .replace(" :: ", "::")
                            .replace(" < ", "<")
                            .replace(" >", ">")
                            .replace("& ", "&")
                    ),
                    None if r.mutability.is_some() && r.reference.is_some() => {
                        "`&mut self`".to_owned()
                    }
                    None => "`self` by value".to_owned(),
                };
                cx.error(
                    method.span(),
                    format!(
                        "`recover = self.{method}` needs a method taking `&self`: the hook and \
                         the body both use `self`, so it is borrowed for both; this one takes \
                         {takes}"
                    ),
                )
            }
            None => cx.error(
                method.span(),
                format!(
                    "`recover = self.{method}` needs a method taking `&self`, and this function \
                     has no `self`; name a free function instead (`recover = {method}`)"
                ),
            ),
        }
    }

    // `tenant = shared` with a parameter called `shared` would make the bare
    // word mean two things: refuse rather than silently merge tenants.
    if let Some(Tenant::Shared(span)) = &attr.tenant {
        if params
            .iter()
            .any(|p| p.name.as_ref().is_some_and(|n| n.unraw() == "shared"))
        {
            cx.error(
                *span,
                "`tenant = shared` is the opt-out (one namespace for every tenant), but this \
                 function also has a parameter called `shared`; write `tenant = (shared)` to use \
                 the parameter as the tenant, or rename the parameter",
            );
        }
    }

    // `tx` names a parameter.
    let tx: Option<Ident> = attr
        .tx
        .as_ref()
        .and_then(|expr| match attr::plain_ident(expr) {
            Some(id)
                if params
                    .iter()
                    .any(|p| !p.is_self && p.name.as_ref().is_some_and(|n| same_name(n, id))) =>
            {
                Some(id.clone())
            }
            _ => {
                cx.error_spanned(
                    attr::ungroup(expr),
                    format!(
                        "`tx` must name a parameter of this function holding the transaction \
                     or connection, e.g. `tx = tx` for `tx: &mut sqlx::Transaction<'_, Postgres>`; \
                     parameters: {}",
                        // `self` cannot hold the transaction: not offered.
                        param_list(params.iter().filter(|p| !p.is_self))
                    ),
                );
                None
            }
        });

    // `tx` with `store`.
    if let (Some(tx), Some(store)) = (&attr.tx, &attr.store) {
        let mut e = syn::Error::new_spanned(
            attr::ungroup(tx),
            "`tx` and `store` cannot be used together: with `tx` the records live in the \
             transaction's database; remove `store`",
        );
        e.combine(syn::Error::new_spanned(
            attr::ungroup(store),
            "`store` given here",
        ));
        cx.syn_error(e);
    }

    // `fingerprint = false` with `skip`.
    let fingerprint_on = attr.fingerprint.as_ref().is_none_or(|(_, on)| *on);
    if let (Some((fp_name, false)), Some((skip_name, _))) = (&attr.fingerprint, &attr.skip) {
        let mut e = syn::Error::new(
            skip_name.span(),
            "`skip(...)` has no effect with `fingerprint = false` (nothing is fingerprinted); \
             remove one of them",
        );
        e.combine(syn::Error::new(
            fp_name.span(),
            "`fingerprint = false` given here",
        ));
        cx.syn_error(e);
    }

    // `skip` names parameters.
    let skipped: Vec<Ident> = attr.skip.map(|(_, names)| names).unwrap_or_default();
    for (i, name) in skipped.iter().enumerate() {
        if skipped[..i].iter().any(|n| same_name(n, name)) {
            cx.error(name.span(), format!("`{name}` is listed twice in `skip`"));
            continue;
        }
        if !params
            .iter()
            .any(|p| p.name.as_ref().is_some_and(|n| same_name(n, name)))
        {
            let named: Vec<String> = params
                .iter()
                .filter_map(|p| p.name.as_ref().map(name_text))
                .collect();
            let hint = nearest(&name.to_string(), named.iter().map(String::as_str), Some(3))
                .map(|s| format!("did you mean `{s}`? "))
                .unwrap_or_default();
            cx.error(
                name.span(),
                format!(
                    "`skip` names `{name}`, but `{}` has no parameter `{name}`; {hint}parameters: {}",
                    sig.ident,
                    param_list(&params)
                ),
            );
        }
    }

    // Which parameters are fingerprinted: all but a borrowed `self` (the
    // service the method runs on), the skipped ones and those named directly
    // by `key`, `tenant`, `store` or `tx`. A by-value `self` is the request
    // itself (a command consumed by its `execute(self)`), so it counts.
    let named_directly: Vec<&Ident> = [
        attr.key.as_ref().and_then(attr::plain_ident),
        match &attr.tenant {
            Some(Tenant::Expr(e)) => attr::plain_ident(e),
            _ => None,
        },
        attr.store.as_ref().and_then(attr::plain_ident),
        tx.as_ref(),
    ]
    .into_iter()
    .flatten()
    .collect();
    let mut fingerprinted = Vec::new();
    if fingerprint_on {
        for p in &params {
            if p.is_self && !p.by_value_self {
                continue;
            }
            match &p.name {
                Some(n)
                    if named_directly.iter().any(|d| same_name(d, n))
                        || skipped.iter().any(|k| same_name(k, n)) => {}
                Some(n) => fingerprinted.push(Fingerprinted {
                    name: n.clone(),
                    cfgs: p.cfgs.clone(),
                    receiver: p.is_self,
                }),
                None if p.is_wildcard => cx.error(
                    p.span,
                    "a `_` parameter cannot be fingerprinted because it has no name; name it \
                     (`_unused: u8`) and list it in `skip(...)` if it is not part of the \
                     request, or turn the fingerprint off with `fingerprint = false`",
                ),
                None => cx.error(
                    p.span,
                    "this parameter is a pattern, so #[idempotent] cannot name it in the \
                     fingerprint; bind it to a name (`pair: (u8, u8)`) and destructure it in \
                     the body, or turn the fingerprint off with `fingerprint = false`",
                ),
            }
        }
    }

    // The manifest: membership, retirement, defaults. Only a well-formed scope
    // is looked up (a malformed one has its own error already).
    let valid_scope = attr
        .scope
        .as_ref()
        .and_then(|(lit, valid)| valid.then_some(lit));
    let mut ttl = attr.ttl;
    let mut lease = attr.lease;
    if let (Some(lit), Some(manifest)) = (valid_scope, &env.manifest) {
        match manifest {
            Err(e) => cx.error(lit.span(), e),
            Ok(m) => match m.check_scope(&lit.value()) {
                Ok(defaults) => {
                    ttl = ttl.or(defaults.ttl);
                    lease = lease.or(defaults.lease);
                }
                Err(e) => cx.error(lit.span(), e),
            },
        }
    }
    let ttl = ttl.unwrap_or(DEFAULT_TTL);
    let lease = lease.unwrap_or(DEFAULT_LEASE);

    // One function per scope in this crate, unless every claimant says
    // `shared_scope` and they agree (rules 18 and 21).
    if let (Some(lit), Some(place)) = (valid_scope, &env.claim) {
        let claim_of_this_function = claims::Claim {
            site: claims::Site {
                function: sig.ident.to_string(),
                file: place.file.clone(),
                line: place.line,
            },
            shared: attr.shared_scope,
            fingerprint: fingerprint_on.then(|| {
                let mut names: Vec<String> =
                    fingerprinted.iter().map(|f| name_text(&f.name)).collect();
                names.sort();
                names
            }),
            under_cfg: fingerprinted
                .iter()
                .filter(|f| !f.cfgs.is_empty())
                .map(|f| name_text(&f.name))
                .collect(),
            ttl,
            recovers: attr.recover.is_some(),
            shared_tenant: matches!(attr.tenant, Some(Tenant::Shared(_))),
            records_errors: !matches!(attr.errors, Errors::Release),
        };
        claim(cx, lit, place, claim_of_this_function);
    }

    let (Some((scope, _)), Some(key), Some(tenant)) = (attr.scope, attr.key, attr.tenant) else {
        return None;
    };
    Some(Spec {
        scope,
        key,
        tenant,
        store: attr.store,
        tx,
        fingerprint: fingerprint_on,
        ttl,
        lease,
        in_progress: attr.in_progress,
        errors: attr.errors,
        recover: attr.recover,
        shared_scope: attr.shared_scope,
        krate: attr
            .krate
            .unwrap_or_else(|| quote::quote!(::idempotent_runtime)),
        fingerprinted,
        manifest: env.manifest_path.clone(),
    })
}

/// Records `claim` on its scope and reports a refusal (rules 18 and 21).
fn claim(cx: &Ctxt, lit: &LitStr, place: &ClaimPlace, claim: claims::Claim) {
    let scope = lit.value();
    let site = claim.site.clone();
    match claims::claim(&place.krate, &scope, claim) {
        Ok(()) => {}
        Err(claims::Refusal::Duplicate { others }) => cx.error(
            lit.span(),
            claims::duplicate_message(&scope, &others, &site),
        ),
        Err(claims::Refusal::Disagree { other, what }) => cx.error(
            lit.span(),
            format!(
                "scope `{scope}` is shared (`shared_scope`) by {} and {}, but {what}",
                other.site, site
            ),
        ),
    }
}

#[cfg(test)]
mod tests;
