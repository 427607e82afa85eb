//! Layer: HTTP. The server-side layer (`http_server`), the retrying client
//! (`http_client`), the example server SIGKILLed and restarted
//! (`http_crash`), and the trailers and extensions of the first answer and
//! of a replay (`http_trailers`), request bodies that cannot be read
//! (`http_body_errors`), the layer's own refusals seen by a layer around it
//! (`http_layer_refusals`), rule 22 end to end on every store with requests
//! written byte for byte (`http_retry_contract`), an attacker's hunt on rule
//! 22 across servers, takeovers and versions (`http_hunt`). `http_app` is the shared
//! test application.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/http.rs"]
mod http_app;

mod http_body_errors;
mod http_client;
mod http_client_sqlite;
mod http_crash;
mod http_edges;
mod http_hunt;
mod http_layer_recover_every_store;
mod http_layer_refusals;
mod http_request_identity;
mod http_retry_contract;
mod http_safe_methods;
mod http_server;
mod http_trailers;
