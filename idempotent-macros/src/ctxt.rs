//! The error accumulator (serde_derive's `Ctxt`): every check records its
//! mistakes here and carries on, and the macro reports them all in one round.

use proc_macro2::Span;
use std::cell::RefCell;
use std::fmt::Display;

/// Collects `syn::Error`s. Must be finished with [`Ctxt::check`]; dropping it
/// unchecked is a bug in the macro (errors would be lost) and panics.
pub(crate) struct Ctxt {
    errors: RefCell<Option<Vec<syn::Error>>>,
}

impl Ctxt {
    pub fn new() -> Self {
        Ctxt {
            errors: RefCell::new(Some(Vec::new())),
        }
    }

    /// A mistake at `span`.
    pub fn error(&self, span: Span, message: impl Display) {
        self.syn_error(syn::Error::new(span, message));
    }

    /// A mistake in `tokens`, spanned from their first token to their last
    /// (`self.0`, not `self`): a `Span` of its own covers one token, as
    /// joining spans is not available to a proc macro on stable Rust.
    pub fn error_spanned(&self, tokens: impl quote::ToTokens, message: impl Display) {
        self.syn_error(syn::Error::new_spanned(tokens, message));
    }

    /// A mistake already in `syn::Error` form (possibly several combined).
    pub fn syn_error(&self, error: syn::Error) {
        if let Some(errors) = self.errors.borrow_mut().as_mut() {
            errors.push(error);
        }
    }

    /// Every recorded mistake, combined into one `syn::Error` (which expands to
    /// one `compile_error!` per mistake, each at its own span).
    pub fn check(self) -> Result<(), syn::Error> {
        let errors = self.errors.borrow_mut().take().unwrap_or_default();
        let mut all = errors.into_iter();
        match all.next() {
            None => Ok(()),
            Some(mut first) => {
                for e in all {
                    first.combine(e);
                }
                Err(first)
            }
        }
    }
}

impl Drop for Ctxt {
    fn drop(&mut self) {
        if !std::thread::panicking() && self.errors.borrow().is_some() {
            panic!("Ctxt dropped without check()");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combines_every_error_in_order() {
        let cx = Ctxt::new();
        assert!(cx.check().is_ok());
        let cx = Ctxt::new();
        cx.error(Span::call_site(), "one");
        cx.syn_error(syn::Error::new(Span::call_site(), "two"));
        let all: Vec<String> = cx
            .check()
            .unwrap_err()
            .into_iter()
            .map(|e| e.to_string())
            .collect();
        assert_eq!(all, ["one", "two"]);
    }
}
