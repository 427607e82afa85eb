//! The annotated item, parsed the way tracing-attributes' `MaybeItemFn` does:
//! attributes, visibility and signature are parsed; the body is kept as
//! tokens. A syntax error inside the body is therefore not ours to report:
//! the body is re-emitted as written and rustc reports the error itself, at
//! its place.

use proc_macro2::{Delimiter, Group, Span, TokenStream};
use quote::{quote, ToTokens, TokenStreamExt};
use syn::parse::{Parse, ParseStream};
use syn::{Attribute, Signature, Token, Visibility};

/// A function whose body has not been parsed.
pub(crate) struct MaybeItemFn {
    pub outer_attrs: Vec<Attribute>,
    /// `#![...]` at the start of the body; they apply to the function.
    pub inner_attrs: Vec<Attribute>,
    pub vis: Visibility,
    pub sig: Signature,
    /// The span of the body's braces.
    pub brace_span: Span,
    /// Everything inside the braces after the inner attributes, unparsed.
    pub body: TokenStream,
}

impl Parse for MaybeItemFn {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let outer_attrs = input.call(Attribute::parse_outer)?;
        let vis: Visibility = input.parse()?;
        let sig: Signature = input.parse()?;
        if input.peek(Token![;]) {
            return Err(input.error(
                "found a declaration without a body; put #[idempotent] on the \
                 method in the `impl` block",
            ));
        }
        let content;
        let brace = syn::braced!(content in input);
        let inner_attrs = content.call(Attribute::parse_inner)?;
        let body: TokenStream = content.parse()?;
        if !input.is_empty() {
            return Err(input.error("unexpected tokens after the function"));
        }
        Ok(MaybeItemFn {
            outer_attrs,
            inner_attrs,
            vis,
            sig,
            brace_span: brace.span.join(),
            body,
        })
    }
}

impl ToTokens for MaybeItemFn {
    fn to_tokens(&self, tokens: &mut TokenStream) {
        tokens.append_all(&self.outer_attrs);
        self.vis.to_tokens(tokens);
        self.sig.to_tokens(tokens);
        let mut inside = TokenStream::new();
        inside.append_all(&self.inner_attrs);
        inside.extend(self.body.clone());
        let mut group = Group::new(Delimiter::Brace, inside);
        group.set_span(self.brace_span);
        tokens.append(group);
    }
}

/// The `#[cfg]`s written on the parameter `name`, and the `#[cfg_attr]`s
/// that may give one (cut down to their `cfg`s). rustc leaves them on an
/// attribute macro's input; one compiled out is not there to fingerprint.
/// Taken from the parameter's own attributes, not looked up by its name: two
/// parameters may share a name under opposite `#[cfg]`s.
pub(crate) fn cfgs_of(attrs: &[syn::Attribute]) -> Vec<TokenStream> {
    attrs
        .iter()
        .filter_map(|a| only_cfg(&a.meta).map(|meta| quote!(#[#meta])))
        .collect()
}

/// `meta` if it is a `cfg`; a `cfg_attr` with only the `cfg`s it gives (at
/// any depth), or `None` when it gives none. The predicate is kept as its
/// tokens (`true`, `feature = "x"`, `all(..)`); an attribute after it that
/// does not parse is left out (rustc reports it on the parameter).
fn only_cfg(meta: &syn::Meta) -> Option<TokenStream> {
    if meta.path().is_ident("cfg") {
        return Some(quote!(#meta));
    }
    if !meta.path().is_ident("cfg_attr") {
        return None;
    }
    let list = meta.require_list().ok()?;
    let mut parts = split_at_commas(list.tokens.clone()).into_iter();
    let predicate = parts.next().filter(|p| !p.is_empty())?;
    let kept: Vec<TokenStream> = parts
        .filter_map(|part| syn::parse2::<syn::Meta>(part).ok())
        .filter_map(|meta| only_cfg(&meta))
        .collect();
    (!kept.is_empty()).then(|| quote!(cfg_attr(#predicate, #(#kept),*)))
}

/// `tokens` split at its top-level commas (a trailing comma gives no part).
fn split_at_commas(tokens: TokenStream) -> Vec<TokenStream> {
    let mut parts = vec![TokenStream::new()];
    for tree in tokens {
        match &tree {
            proc_macro2::TokenTree::Punct(p) if p.as_char() == ',' => {
                parts.push(TokenStream::new());
            }
            _ => parts
                .last_mut()
                .into_iter()
                .for_each(|part| part.extend([tree.clone()])),
        }
    }
    parts.retain(|part| !part.is_empty());
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    #[test]
    fn the_body_is_not_parsed() {
        let item: MaybeItemFn = syn::parse2(quote!(
            #[doc = "x"]
            pub async fn f(a: u8) -> Result<u8, E> {
                #![allow(unused)]
                let = ;
            }
        ))
        .unwrap();
        assert_eq!(item.outer_attrs.len(), 1);
        assert_eq!(item.inner_attrs.len(), 1);
        assert_eq!(item.sig.ident, "f");
        assert_eq!(item.body.to_string(), "let = ;");
        let again = item.to_token_stream().to_string();
        assert!(again.contains("# ! [allow (unused)] let = ;"), "{again}");
    }

    #[test]
    fn not_a_function_with_a_body() {
        for tokens in [
            quote!(
                struct S;
            ),
            quote!(
                async fn f(&self) -> Result<u8, E>;
            ),
        ] {
            assert!(syn::parse2::<MaybeItemFn>(tokens).is_err());
        }
        let e = syn::parse2::<MaybeItemFn>(quote!(
            async fn f() -> u8;
        ))
        .err()
        .unwrap();
        assert!(e.to_string().contains("without a body"), "{e}");
    }
}
