//! Code generation. The signature, attributes and visibility are re-emitted as
//! written (original spans); the body is wrapped as the tokens it was written
//! with (never parsed, so rustc reports its syntax errors itself), and
//! everything the wrapper does is a call into `idempotent_runtime::__private`.

use crate::attr::{self, Errors, InProgress, Tenant};
use crate::check::{self, Env, Spec};
use crate::item::MaybeItemFn;
use proc_macro2::{Ident, Span, TokenStream};
use quote::{quote, quote_spanned, ToTokens};
use std::time::Duration;
use syn::ext::IdentExt;
use syn::spanned::Spanned;

/// The whole macro: parse, validate, generate. On any error, the original
/// item plus every error (tokio-macros style), so one mistake does not cascade
/// into "function not found" errors elsewhere.
pub(crate) fn entry(attr: TokenStream, item: TokenStream) -> TokenStream {
    let func: MaybeItemFn = match syn::parse2(item.clone()) {
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
    let env = Env::from_compiler(&func);
    match check::validate(attr, Span::call_site(), &func, &env) {
        Ok(spec) => generate(&func, &spec),
        Err(e) => with_error(item, e),
    }
}

/// The item as written (so callers still compile) plus the errors. Unused
/// parameters are expected while the attribute is broken; do not add noise.
fn with_error(item: TokenStream, error: syn::Error) -> TokenStream {
    let error = error.to_compile_error();
    quote!(#[allow(unused_variables)] #item #error)
}

fn duration(krate: &TokenStream, d: Duration) -> TokenStream {
    let millis = d.as_millis();
    if d.subsec_nanos().is_multiple_of(1_000_000) && u64::try_from(millis).is_ok() {
        let millis = millis as u64;
        quote!(#krate::__private::millis(#millis))
    } else {
        let (secs, nanos) = (d.as_secs(), d.subsec_nanos());
        quote!(#krate::__private::duration(#secs, #nanos))
    }
}

pub(crate) fn generate(func: &MaybeItemFn, spec: &Spec) -> TokenStream {
    let krate = &spec.krate;
    let MaybeItemFn {
        outer_attrs,
        inner_attrs,
        vis,
        sig,
        ..
    } = func;
    // The body's statements go straight into the async block that runs them:
    // wrapped in its own braces as the block's tail, a one-line body would
    // draw rustc's `unused_braces` lint at the user's braces.
    let body_tokens = &func.body;
    let name = &sig.ident;
    let name_text = name.to_string();
    let scope = &spec.scope;
    let ret = match &sig.output {
        syn::ReturnType::Type(_, ty) => quote!(#ty),
        syn::ReturnType::Default => quote!(()), // unreachable: validated to be a Result
    };

    let file = quote_spanned!(name.span()=> ::core::file!());
    let line = quote_spanned!(name.span()=> ::core::line!());
    let ttl = duration(krate, spec.ttl);
    let lease = duration(krate, spec.lease);
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
            let text = attr::path_text(path);
            (
                quote!(#krate::__private::ErrorPolicy::RecordIf(#text)),
                quote!(#krate::__private::RecordErrorsIf(#path)),
            )
        }
    };
    let transactional = spec.tx.is_some();
    let fingerprinted = spec.fingerprint;
    let shared = matches!(spec.tenant, Tenant::Shared(_));
    // A parameter under `#[cfg]` is fingerprinted (and listed) only where it
    // is compiled in: its `#[cfg]`s go on what names it.
    let fp_names = spec.fingerprinted.iter().map(|f| {
        let (text, cfgs) = (check::name_text(&f.name), &f.cfgs);
        quote!(#(#cfgs)* #text)
    });

    let manifest_tracking = spec.manifest.as_ref().map(|p| {
        let p = p.display().to_string();
        quote!(
            const _: &[u8] = ::core::include_bytes!(#p);
        )
    });

    // The key and the tenant are borrowed with their own spans, so a type
    // that is not `Display` is reported at the expression, not the attribute.
    let key = &spec.key;
    let key = quote_spanned!(key.span()=> &(#key));
    let identity = match &spec.tenant {
        Tenant::Shared(_) => {
            quote!(#krate::__private::shared_identity(&__IDEMPOTENT_SCOPE, #key))
        }
        Tenant::Expr(tenant) => {
            let tenant = quote_spanned!(tenant.span()=> &(#tenant));
            quote!(#krate::__private::identity(&__IDEMPOTENT_SCOPE, #tenant, #key))
        }
    };
    let builder = Ident::new("__idempotent_fp", Span::call_site());
    // The claimants of a shared scope answer for each other: their
    // fingerprints must agree on the same request, whoever's instantiation.
    // With `fingerprint = false` the arguments are not compared, but the
    // answer's type still is: a record of `load::<User>` replayed to
    // `load::<Invoice>` would be decoded as an `Invoice` when the JSON fits
    // and handed over as that call's own answer.
    let instantiations = if spec.shared_scope {
        Vec::new()
    } else {
        instantiation_of(sig, spec, &builder, !spec.fingerprint)
    };
    let fingerprint = if spec.fingerprinted.is_empty() && instantiations.is_empty() {
        quote!(::core::result::Result::Ok(::core::option::Option::None))
    } else {
        // Spanned at each parameter, so "`T` is not Serialize" points at it. The
        // builder's name keeps the attribute's span, as where it is declared: a
        // function written at a `macro_rules!` call site and an attribute written
        // in the macro are two hygiene contexts, and a name spanned at the
        // parameter would not see a binding spanned at the attribute.
        let arguments = spec.fingerprinted.iter().map(|f| {
            let (name, text, cfgs) = (&f.name, check::name_text(&f.name), &f.cfgs);
            let add = if f.receiver {
                Ident::new("fingerprint_receiver", Span::call_site())
            } else {
                Ident::new("fingerprint_argument", Span::call_site())
            };
            quote_spanned!(name.span()=> #(#cfgs)* #krate::__private::#add(&mut #builder, #text, &#name);)
        });
        quote!({
            let mut #builder = #krate::__private::FingerprintBuilder::new();
            #(#arguments)*
            #(#instantiations)*
            #builder.finish()
        })
    };

    let recover_name = match &spec.recover {
        Some(hook) => {
            let text = hook.text();
            quote!(::core::option::Option::Some(#text))
        }
        None => quote!(::core::option::Option::None),
    };
    let shared_scope = spec.shared_scope;
    let recover = match &spec.recover {
        None => quote!(#krate::__private::NoRecover),
        Some(hook) => {
            // One binding, named with the attribute's span, so it is the
            // same name under any hygiene. Where it is passed to the hook it
            // is located at the hook (`located_at` keeps the name's
            // resolution): a hook taking the wrong parameters is reported at
            // `recover = hook`, not at the whole attribute.
            let takeover = Ident::new("__idempotent_takeover", Span::call_site());
            let ask = match hook {
                attr::Recover::Function(path) => {
                    let at = Span::call_site().located_at(path.span());
                    let takeover = Ident::new("__idempotent_takeover", at);
                    quote_spanned!(path.span()=> #path(&#takeover).await)
                }
                // `self` is `&Self` (checked): the closure copies the reference.
                attr::Recover::Method { method, receiver } => {
                    let at = Span::call_site().located_at(method.span());
                    let takeover = Ident::new("__idempotent_takeover", at);
                    // The method's own `self`, so the call resolves as the
                    // body's does (also when a macro wrote the method),
                    // located at the method's name: a hook of the wrong type
                    // is reported at `recover = self.hook`, not from there to
                    // the signature's `self`.
                    let receiver = syn::token::SelfValue {
                        span: receiver
                            .map_or_else(Span::call_site, |token| token.span)
                            .located_at(method.span()),
                    };
                    quote_spanned!(method.span()=> #receiver.#method(&#takeover).await)
                }
            };
            quote!(#krate::__private::RecoverWith(
                move |#takeover: #krate::__private::Takeover| async move {
                    #krate::__private::recovery::<#ret>(#ask)
                }
            ))
        }
    };

    let prelude = quote! {
        static __IDEMPOTENT_SCOPE: #krate::__private::ScopeInfo =
            #krate::__private::ScopeInfo::new(#krate::__private::ScopeSpec {
                scope: #scope,
                function: ::core::concat!(::core::module_path!(), "::", #name_text),
                file: #file,
                line: #line,
                ttl: #ttl,
                lease: #lease,
                in_progress: #in_progress,
                errors: #error_policy,
                transactional: #transactional,
                fingerprinted: #fingerprinted,
                fingerprinted_parameters: &[#(#fp_names),*],
                shared_tenant: #shared,
                recover: #recover_name,
                shared_scope: #shared_scope,
            });
        #krate::__private::inventory::submit! {
            #krate::__private::Registration(&__IDEMPOTENT_SCOPE)
        }
        const _: ::core::option::Option<&str> = ::core::option_env!("IDEMPOTENT_MANIFEST");
        #manifest_tracking
    };

    // The body's async block returns the function's type from its first
    // statement on (tracing-attributes' "fake return"), so rustc checks the
    // body's tail and `return`s against it and reports a wrong type there as
    // "mismatched types", instead of at the attribute as an unmet bound of
    // the block's future. Never runs; a call rather than a diverging
    // expression, so no lint needs allowing (a crate may forbid them).
    //
    // The type is named outside the block, through a marker bound there: the
    // body's statements share the block, and an item of the body's own (a
    // `struct Error`, a `use std::io::*`) would otherwise shadow a name in
    // the return type. The marker's name is not visible to the body.
    let marker = Ident::new("__idempotent_ret", Span::mixed_site());
    let bind_marker = quote!(let #marker = ::core::marker::PhantomData::<#ret>;);
    let typed = quote! {
        if false {
            return #krate::__private::never_of(#marker);
        }
    };
    // The async block's braces are the body's own, so an error about the
    // body as a whole (a tail that is not the function's type) points there.
    let async_body = {
        let mut group =
            proc_macro2::Group::new(proc_macro2::Delimiter::Brace, quote!(#typed #body_tokens));
        group.set_span(func.brace_span);
        group
    };
    let body = match &spec.tx {
        None => {
            let store = match &spec.store {
                None => quote!(#krate::__private::default_store(&__IDEMPOTENT_SCOPE)),
                Some(expr) => {
                    // Spanned at the expression: a value that is not a store
                    // is reported there.
                    let as_dyn_store = syn::Ident::new("as_dyn_store", expr.span());
                    quote!({
                        use #krate::__private::AsDynStore as _;
                        #krate::__private::store(__idempotent_store.#as_dyn_store())
                    })
                }
            };
            // `&(expr)` keeps a place expression (`self.store`) borrowed rather than
            // moved, and extends a temporary's life (`store = handle.clone()`).
            let bind_store = spec
                .store
                .as_ref()
                .map(|expr| quote!(let __idempotent_store = &(#expr);));
            quote! {
                #prelude
                #bind_marker
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
                    #krate::__private::body::<#ret, _>(async move #async_body),
                )
                .await
            }
        }
        Some(tx) => {
            // Spanned at the parameter: a value that is not a transaction or
            // connection is reported there.
            let tx = quote_spanned!(tx.span()=> &mut *#tx);
            quote! {
                #prelude
                #bind_marker
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
                    #tx,
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
                    #krate::__private::body::<#ret, _>(async #async_body),
                )
                .await;
                #krate::__private::finish_in_transaction::<#ret, _, _>(
                    __idempotent_held,
                    &__idempotent_errors,
                    #tx,
                    __idempotent_result,
                )
                .await
            }
        }
    };

    quote! {
        #(#outer_attrs)*
        #vis #sig {
            #(#inner_attrs)*
            #body
        }
    }
}

/// What tells one instantiation of the function from another, added to the
/// fingerprint (the runtime's `FingerprintBuilder::instantiation`): each type
/// parameter's type and each const parameter's value, unless only
/// parameters left out of the fingerprint mention it (skipped ones, the key,
/// the tenant, the store or the transaction: `E: Executor` given a pool by
/// one caller and a transaction by another is one request). Whether a
/// parameter's value shows its type cannot be told from here (`Id<T>`
/// holding a number and a `PhantomData<T>`), so a type parameter that a
/// fingerprinted parameter mentions counts too: `f::<u8>(7)` and
/// `f::<i64>(7)` are two requests; and so does one the return type
/// mentions, whatever else does: the answer is of that type, and
/// `load::<Invoice>` must not replay what `load::<User>` recorded.
///
/// `Self` too: always when the return type mentions it (a trait's
/// `create(..) -> Result<Self, E>` for each implementor); for a method, when
/// `Self` is an instantiation of a generic type (`Repo<User>`, `Buf<5>`: the
/// impl's parameters, which the attribute cannot see, may shape the answer).
/// All instantiations share the one scope.
///
/// `answer_only` (`fingerprint = false`: no argument is compared): only what
/// the arguments do not show counts, the type and const parameters the
/// return type mentions or no parameter mentions (`create::<User>(key)`) and
/// `Self` as above, so a record is never replayed to another instantiation;
/// the type parameters only the parameters' types mention do not.
fn instantiation_of(
    sig: &syn::Signature,
    spec: &Spec,
    builder: &Ident,
    answer_only: bool,
) -> Vec<TokenStream> {
    let krate = &spec.krate;
    let in_answer = |ident: &Ident| match &sig.output {
        syn::ReturnType::Type(_, ty) => mentions(ty.to_token_stream(), ident),
        syn::ReturnType::Default => false,
    };
    let fingerprinted = |name: &Ident| spec.fingerprinted.iter().any(|f| f.name == *name);
    // Only the parameters left out, and only those compiled in everywhere.
    let left_out_only = |ident: &Ident| {
        let (mut by_left_out, mut by_fingerprinted) = (false, false);
        for input in &sig.inputs {
            let syn::FnArg::Typed(t) = input else {
                continue;
            };
            match &*t.pat {
                // A left-out parameter counts only where its type surely
                // is the type parameter (taking it out of the fingerprint
                // on a mere likeness could merge two instantiations).
                syn::Pat::Ident(p) if !fingerprinted(&p.ident) => {
                    by_left_out |=
                        crate::item::cfgs_of(&t.attrs).is_empty() && holds_type(&t.ty, ident);
                }
                // A fingerprinted one on any likeness (it only keeps it in).
                _ => by_fingerprinted |= mentions(t.ty.to_token_stream(), ident),
            }
        }
        by_left_out && !by_fingerprinted
    };
    let mentioned_by_parameters = |ident: &Ident| {
        sig.inputs.iter().any(|input| match input {
            syn::FnArg::Typed(t) => mentions(t.ty.to_token_stream(), ident),
            syn::FnArg::Receiver(r) => mentions(r.ty.to_token_stream(), ident),
        })
    };
    let mut out = Vec::new();
    for param in &sig.generics.params {
        let (ident, attrs) = match param {
            syn::GenericParam::Type(t) => (&t.ident, &t.attrs),
            syn::GenericParam::Const(c) => (&c.ident, &c.attrs),
            syn::GenericParam::Lifetime(_) => continue,
        };
        // Counted by builds before `v3` too, or only since (the answer's
        // type alone: what they stored is compared without it).
        let (add_type, add_const) = if answer_only {
            // Not an argument's type: the answer's, or one no parameter
            // shows (`create::<User>(key)`), which only the call tells.
            if in_answer(ident) || !mentioned_by_parameters(ident) {
                ("fingerprint_answer_type", "fingerprint_answer_const")
            } else {
                continue;
            }
        } else if !left_out_only(ident) {
            ("fingerprint_type", "fingerprint_const")
        } else if in_answer(ident) {
            ("fingerprint_answer_type", "fingerprint_answer_const")
        } else {
            continue;
        };
        let (name, cfgs) = (format!("<{}>", ident.unraw()), crate::item::cfgs_of(attrs));
        out.push(match param {
            syn::GenericParam::Type(_) => {
                let add = Ident::new(add_type, Span::call_site());
                quote!(#(#cfgs)* #krate::__private::#add(
                    &mut #builder, #name, ::core::any::type_name::<#ident>());)
            }
            _ => {
                let add = Ident::new(add_const, Span::call_site());
                quote!(#(#cfgs)* #krate::__private::#add(&mut #builder, #name, &#ident);)
            }
        });
    }
    // An `impl Trait` parameter is an anonymous type parameter, counted as
    // a named one a fingerprinted parameter mentions is (not with
    // `fingerprint = false`: it cannot be the answer's type).
    if !answer_only {
        for input in &sig.inputs {
            let syn::FnArg::Typed(t) = input else {
                continue;
            };
            let syn::Pat::Ident(p) = &*t.pat else {
                continue;
            };
            if !fingerprinted(&p.ident) || !has_impl_trait(&t.ty) {
                continue;
            }
            let name = &p.ident;
            let (text, cfgs) = (
                format!("<impl {}>", check::name_text(name)),
                crate::item::cfgs_of(&t.attrs),
            );
            let add = Ident::new("fingerprint_impl_type", Span::call_site());
            out.push(
                quote_spanned!(name.span()=> #(#cfgs)* #krate::__private::#add(
                &mut #builder, #text, ::core::any::type_name_of_val(&#name));),
            );
        }
    }
    if in_answer(&Ident::new("Self", Span::call_site())) {
        out.push(quote!(#krate::__private::fingerprint_answer_type(
            &mut #builder, "<Self>", ::core::any::type_name::<Self>());));
    } else if sig.receiver().is_some() {
        out.push(quote!(#krate::__private::fingerprint_generic_self(
            &mut #builder, ::core::any::type_name::<Self>());));
    }
    out
}

/// Whether `ty` has an `impl Trait` anywhere (`impl Serialize`,
/// `TypedId<impl Model>`, `&[impl Serialize]`).
fn has_impl_trait(ty: &syn::Type) -> bool {
    struct Finder(bool);
    impl<'ast> syn::visit::Visit<'ast> for Finder {
        fn visit_type_impl_trait(&mut self, _: &'ast syn::TypeImplTrait) {
            self.0 = true;
        }
    }
    let mut finder = Finder(false);
    syn::visit::Visit::visit_type(&mut finder, ty);
    finder.0
}

/// Whether `tokens` (a type) name `ident` anywhere, at any depth (`r#T`
/// and `T` alike).
fn mentions(tokens: TokenStream, ident: &Ident) -> bool {
    tokens.into_iter().any(|t| match t {
        proc_macro2::TokenTree::Ident(i) => i.unraw() == ident.unraw(),
        proc_macro2::TokenTree::Group(g) => mentions(g.stream(), ident),
        _ => false,
    })
}

/// Whether the type `ty` surely holds the type parameter `ident` itself:
/// `T`, `&mut T`, `Vec<T>`, `(T, u8)`, `[T]`. Not a path that merely starts
/// or ends with its name (`T::Ctx`, `my::T`), an associated type's binding
/// (`Iterator<Item = u8>`), a lifetime, a bound or a type macro.
fn holds_type(ty: &syn::Type, ident: &Ident) -> bool {
    match ty {
        syn::Type::Path(p) if p.qself.is_none() => {
            let segments = &p.path.segments;
            if p.path.leading_colon.is_none()
                && segments.len() == 1
                && segments[0].ident.unraw() == ident.unraw()
                && segments[0].arguments.is_none()
            {
                return true;
            }
            segments.iter().any(|segment| match &segment.arguments {
                syn::PathArguments::AngleBracketed(args) => args
                    .args
                    .iter()
                    .any(|a| matches!(a, syn::GenericArgument::Type(t) if holds_type(t, ident))),
                _ => false,
            })
        }
        syn::Type::Reference(r) => holds_type(&r.elem, ident),
        syn::Type::Paren(p) => holds_type(&p.elem, ident),
        syn::Type::Group(g) => holds_type(&g.elem, ident),
        syn::Type::Slice(s) => holds_type(&s.elem, ident),
        syn::Type::Array(a) => holds_type(&a.elem, ident),
        syn::Type::Tuple(t) => t.elems.iter().any(|e| holds_type(e, ident)),
        _ => false,
    }
}
