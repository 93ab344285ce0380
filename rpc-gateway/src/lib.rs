//! # rpc-gateway
//!
//! An HTTP/JSON gateway: every service entry that servers publish in the registry becomes a web
//! route, so browsers, mobile apps and `curl` reach the services with no client library.
//!
//! ## Routes
//!
//! | route | what |
//! |---|---|
//! | `POST /api/{service id}/{method}` | calls the entry; the body is a JSON object of named arguments |
//! | a route declared with `#[http(get = "/orders/{id}")]` | calls the entry; path and query (or body) parameters by name |
//! | `GET /openapi.json` | the OpenAPI 3.1 document of every entry served, with JSON Schemas |
//! | `GET /docs` | a documentation page over that document (its assets are built in) |
//!
//! Arguments: a parameter named in the path template comes from the path; with `GET`, `DELETE`
//! and `HEAD` the others come from the query string (a value is read as JSON unless the
//! parameter's schema is a string, then taken as it is); with other methods they come from a JSON
//! object in the body, whatever its content type (so `curl -d '{"text":"hi"}'` works). A body
//! that is a JSON array is taken as positional arguments. The answer is the method's result as
//! JSON, with status 200.
//!
//! A failed call answers with the status [`route::http_status`] maps (business error 422,
//! overflow and open breaker 503 with `Retry-After`, timeout 504, not authenticated 401, unknown
//! entry 404, ...) and the body [`route::error_body`] writes:
//! `{"code": 1000, "message": "...", "error": <typed error>}`.
//!
//! ## What this crate must not do
//!
//! It holds no governance of its own: every call goes through the governed client
//! ([`rpc_client::Client`]), so timeouts, retries, breakers, fallbacks and routing rules apply
//! as they do to a proxy. It keeps no compiled knowledge of services: everything it serves comes
//! from what servers publish, and follows the registry as servers come and go.

#![warn(missing_docs)]

pub mod docs;
pub mod openapi;
pub mod route;
