//! The `#[idempotent]` attribute. Use it through `idempotent_runtime`, which
//! re-exports it: `use idempotent_runtime::idempotent;`.
//!
//! This crate only parses and validates the attribute and emits calls into
//! `idempotent_runtime::__private`; all run-time behaviour lives in the runtime.

mod attr;
mod check;
mod claims;
mod ctxt;
mod expand;
mod item;

use proc_macro::TokenStream;

/// Makes an `async fn` safe to retry: a call with a key that already completed
/// gets the recorded result instead of running the body again.
///
/// ```ignore
/// use idempotent_runtime::{idempotent, Error};
///
/// #[idempotent(scope = "payments.charge", key = key, tenant = account.id)]
/// async fn charge(account: &Account, key: &str, req: &ChargeRequest) -> Result<Receipt, ChargeError> {
///     gateway.charge(req.amount).await   // runs once per (tenant, scope, key)
/// }
/// ```
///
/// The function keeps the signature you wrote. It must be an `async fn` (free
/// function, `&self` method, generic function, or a method in a trait `impl`)
/// returning `Result<T, E>` — or an alias of one, whatever its name:
/// `io::Result<T>`, `anyhow::Result<T>`, `type ChargeOutcome<T> = Result<T, ChargeError>` — with
/// `T: Serialize + DeserializeOwned` and `E: From<idempotent_runtime::Error>`.
///
/// # Arguments
///
/// Required:
///
/// - **`scope = "payments.charge"`** — a string literal naming the operation.
///   Lowercase segments of `a-z`, `0-9`, `_`, `-` joined by single dots, at most
///   128 bytes. It is part of every record's identity: keep it when you rename
///   the function. Two functions of one crate may not share a scope, unless
///   both say `shared_scope`.
/// - **`key = <expr>`** — the client-supplied idempotency key, any expression
///   over the parameters that is `Display`: `key = key`, `key = req.idempotency_key`.
/// - **`tenant = <expr>`** or **`tenant = shared`** — whose key it is (`Display`):
///   `tenant = account.id`. The same key from two tenants is two records.
///   `shared` opts out: keys are global to the scope. Only the bare identifier
///   `shared` is the opt-out; anything else, `(shared)` included, is an
///   expression over the parameters, so a parameter that is itself called
///   `shared` is written `tenant = (shared)`.
///
/// Optional:
///
/// - **`store = <expr>`** — where records live: `store = self.store`,
///   `store = store` (for `store: &S` with `S: Store`, `&dyn Store`,
///   `Arc<dyn Store>`, ...). Without it, the store set with
///   `idempotent_runtime::set_default_store` is used. In an `&mut self`
///   method the body needs `self` mutably while the store is in use, so hand
///   the call its own handle: `store = self.store.clone()` (stores are cheap
///   handles to a shared pool or map).
/// - **`tx = <parameter>`** — transactional mode: `tx = tx` for
///   `tx: &mut sqlx::Transaction<'_, Postgres>` (or a connection). The reservation
///   and the recorded result are written in that transaction and commit or roll
///   back with your own writes. Cannot be combined with `store`.
/// - **`skip(a, b)`** — parameters left out of the fingerprint (handles,
///   clocks, loggers, anything that is not part of the request). Naming a
///   parameter that is already left out (`self`, or one named directly by
///   `key`/`tenant`/`store`/`tx`) is allowed and changes nothing.
/// - **`fingerprint = false`** — no argument is fingerprinted: a reused key is
///   never refused for carrying different arguments. Cannot be combined with
///   `skip`. A generic function's instantiation still counts where no
///   argument shows it (a type or const parameter the return type mentions or
///   no parameter mentions, `Self` there, a generic `Self`): `load::<Invoice>`
///   is refused, never replayed what `load::<User>` recorded.
/// - **`ttl = "24h"`** — how long a completed record is kept (default `24h`, or
///   the scope's `ttl` in the manifest). At least `1ms`.
/// - **`lease = "30s"`** — how long an in-progress record is held before another
///   caller may take it over; renewed every `lease / 3` while the body runs
///   (default `30s`, or the manifest's `lease`). At least `10ms`.
/// - **`in_progress = wait("10s")`** (default) or **`in_progress = reject`** —
///   what a duplicate gets while the first call runs: wait up to that long for
///   the result, or `Error::InProgress { retry_after }` at once.
/// - **`errors = release`** (default), **`errors = record`** or
///   **`errors = record_if(path::to::predicate)`** — what an `Err(e)` does:
///   free the key so a retry runs again; record `e` as the final answer (then
///   `E: Serialize + DeserializeOwned`); or record only the errors for which
///   `predicate(&e)` returns `true`.
/// - **`recover = path::to::hook`** — asked before a takeover re-runs the body
///   (rule 20). When a call takes over a record whose previous owner's lease
///   expired (the owner crashed, maybe after the side effect and before
///   recording it), `hook` is called first, with the
///   `&idempotent_runtime::Takeover` (tenant, scope, key, attempt number,
///   when the previous attempt started). It is an
///   `async fn(&Takeover) -> Result<idempotent_runtime::Recovery<T>, E>`
///   with this function's `T` and `E`: `Ok(Recovery::Run)` runs the body;
///   `Ok(Recovery::Completed(v))` records `v` and returns it without running
///   the body; `Err(e)` is handled by `errors = ...` (recorded, or, released,
///   the record is kept for the next takeover to ask again), and the body
///   does not run. It is never called on a fresh reservation, a replay or
///   after a release. On a method taking `&self`, **`recover = self.hook`**
///   calls `self.hook(&takeover)`: a method of the same value, which reaches
///   the state the body uses. See `idempotent_runtime::recovery`.
/// - **`shared_scope`** — a flag: this function claims its scope together
///   with others on purpose (rule 21), e.g. an HTTP handler and a queue
///   consumer that both process "refund order 8891" and must deduplicate
///   against each other. Every claimant must say so, and they must
///   fingerprint the same parameter names, have the same `ttl`, and agree on
///   whether they have a `recover` hook, whether the tenant is `shared` and
///   whether they may record errors (`record`/`record_if` or `release`);
///   otherwise it is a compile error naming the sites (across crates,
///   `registry::validate()` reports it).
/// - **`crate = ::path::to::idempotent_runtime`** — where the runtime is, if
///   you renamed or re-exported it.
///
/// # The fingerprint
///
/// Every parameter is fingerprinted (and must be `Serialize`) except: a
/// `self` behind a reference or a smart pointer (`&self`, `self: Arc<Self>`:
/// the service; a plain `self` taken by value is the request and counts
/// unless `skip(self)`);
/// parameters listed in `skip(...)`; and a parameter named *directly* by `key`,
/// `tenant`, `store` or `tx` — the expression is exactly that identifier
/// (`key = key`, or in parentheses: `tenant = (shared)`). An expression that only starts with it (`tenant = account.id`)
/// does not exclude `account`: skip it explicitly if it should not count.
/// A parameter written as a pattern (`(a, b): (u8, u8)`) cannot be named, so it
/// must be bound to a name, or the fingerprint turned off.
///
/// # Checked when the code compiles
///
/// Every argument and duration is validated and every mistake is reported at
/// once, each at the offending token. If a scope manifest (`idempotent.toml`
/// beside the crate's `Cargo.toml`, else at the workspace root, or the file
/// named by the `IDEMPOTENT_MANIFEST` environment variable) exists, the scope
/// must be declared in it and not retired:
///
/// ```toml
/// [scopes."orders.place"]
/// description = "placing an order"
/// ttl = "24h"      # optional default for this scope; the attribute wins
/// lease = "30s"    # optional
/// [retired."orders.place_v1"]
/// reason = "renamed to orders.place"
/// ```
///
/// Editing the manifest rebuilds the crates that use it. Two functions of one
/// crate claiming one scope are a compile error naming both, unless every
/// claimant says `shared_scope` (and they agree as that argument says);
/// across crates, the first annotated call of the process logs it at ERROR,
/// and `idempotent_runtime::registry::validate()` returns it as an error.
///
/// # Through `macro_rules!`
///
/// Arguments passed through a `macro_rules!` metavariable behave exactly as if
/// written directly, whatever the fragment (`$s:literal`, `$e:expr`,
/// `$p:path`, `$i:ident`, `$t:tt`), and so does a whole attribute built by a
/// macro (`#[idempotent($($args)*)]`):
///
/// ```ignore
/// macro_rules! endpoint {
///     ($scope:literal, $key:expr, $($f:tt)*) => {
///         #[idempotent(scope = $scope, key = $key, tenant = shared, ttl = "1h")]
///         $($f)*
///     };
/// }
/// endpoint!("orders.cancel", key, async fn cancel(key: &str) -> Result<(), Error> { Ok(()) });
/// ```
///
/// `key = $k` given `key` names the parameter directly (and leaves it out of the
/// fingerprint); a bad value (`scope = $s` given `"Bad.Scope"`) is reported at
/// the value where the macro is called. `tenant = $t` given `shared` is the
/// opt-out, as `tenant = shared` is, whether `$t` is an `ident` or an `expr`;
/// given `(shared)` it is the parameter. As `macro_rules!` hygiene goes, an
/// argument naming a parameter must come from where the parameter is written:
/// a `key` written inside the macro does not see a parameter `key` written by
/// its caller.
///
/// # The generated code
///
/// The body is run by `idempotent_runtime`'s engine as an `async move` block
/// (in transactional mode a plain `async` block, so the transaction can be used
/// after it). `return` and `?` in the body behave as before. The function is
/// registered (`idempotent_runtime::registry::scopes()`) with its scope, path
/// (`module::function`; for a method `module::method`, as an attribute cannot
/// see the `impl`'s type), the file and line of its name, and its policies.
///
/// The store expression is borrowed for the whole call. If it borrows an owned
/// parameter that the body also moves (`store: Arc<dyn Store>` used in the
/// body), write `store = store.clone(), skip(store)`.
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::entry(attr.into(), item.into()).into()
}
