use proc_macro::TokenStream;
#[proc_macro_attribute]
pub fn idempotent(_a: TokenStream, i: TokenStream) -> TokenStream {
    i
}
