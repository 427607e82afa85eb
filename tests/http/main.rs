//! Layer: HTTP. The server-side layer (`http_server`), the retrying client
//! (`http_client`), and the example server SIGKILLed and restarted
//! (`http_crash`). `http_app` is the shared test application.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/http.rs"]
mod http_app;

mod http_client;
mod http_crash;
mod http_edges;
mod http_server;
