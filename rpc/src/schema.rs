//! JSON Schemas of a service's types, for the [`EntryApi`](rpc_core::EntryApi) a server
//! publishes: what an HTTP gateway validates against and what an API document shows.
//!
//! Why it is built this way: `#[rpc::service]` sees only the tokens of a type, not whether the
//! type implements `schemars::JsonSchema`, and a service whose types derive no schema must still
//! compile. The generated code therefore asks a [`Probe`] for the schema through *autoref
//! specialization*: the method call `(&&Probe::<T>::new()).schema(g)` resolves to
//! [`SchemaViaJsonSchema`] (implemented for `&Probe<T>` where `T: JsonSchema`) when it can, and
//! otherwise, one auto-dereference later, to [`SchemaViaAnyValue`] (implemented for every
//! `Probe<T>`), whose schema is `true`: any value. [`ErrorProbe`] does the same for a method's
//! error type, one level deeper, so that the framework's own `RpcError` (no typed error) has no
//! schema at all.
//!
//! Autoref specialization decides at the call site, on the type as written there: it only works
//! where the type is concrete, since a generic `T` would always take the fallback. The types the
//! generated code probes are a service trait's parameter, result and error types, which are
//! concrete: the macro rejects generic traits and generic methods.

use std::marker::PhantomData;

use rpc_core::{EntrySchemas, RpcError};
use schemars::generate::{SchemaGenerator, SchemaSettings};
use schemars::JsonSchema;
use serde_json::Value;

/// Where named schemas are referred to: an OpenAPI document's components, so that a gateway
/// can put the definitions there as they are.
pub const DEFINITIONS_PATH: &str = "#/components/schemas/";

/// The generator of one entry's schemas: JSON Schema draft 2020-12 (as OpenAPI 3.1 uses), named
/// types as references to `DEFINITIONS_PATH`.
pub fn schema_generator() -> SchemaGenerator {
    SchemaSettings::draft2020_12()
        .with(|s| s.definitions_path = DEFINITIONS_PATH.into())
        .into_generator()
}

/// One entry's schemas, with the definitions `generator` collected while producing them.
pub fn entry_schemas(
    mut generator: SchemaGenerator,
    params: Vec<Value>,
    result: Value,
    error: Option<Value>,
) -> EntrySchemas {
    EntrySchemas {
        params,
        result,
        error,
        definitions: generator.take_definitions(true),
    }
}

/// Stands for the type `T` in a method call that picks [`SchemaViaJsonSchema`] when `T`
/// implements `JsonSchema` and [`SchemaViaAnyValue`] otherwise; call it as
/// `(&&Probe::<T>::new()).schema(&mut generator)`.
pub struct Probe<T: ?Sized>(PhantomData<fn() -> Box<T>>);

impl<T: ?Sized> Probe<T> {
    /// The probe of `T`.
    pub const fn new() -> Self {
        Probe(PhantomData)
    }
}

impl<T: ?Sized> Default for Probe<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// The schema of a type that implements `JsonSchema` (named types as references).
pub trait SchemaViaJsonSchema {
    /// The type's schema; named types are added to `generator`'s definitions.
    fn schema(&self, generator: &mut SchemaGenerator) -> Value;
}

impl<T: JsonSchema + ?Sized> SchemaViaJsonSchema for &Probe<T> {
    fn schema(&self, generator: &mut SchemaGenerator) -> Value {
        generator.subschema_for::<T>().to_value()
    }
}

/// The schema of a type that does not implement `JsonSchema`: `true`, any value.
pub trait SchemaViaAnyValue {
    /// `true`.
    fn schema(&self, generator: &mut SchemaGenerator) -> Value;
}

impl<T: ?Sized> SchemaViaAnyValue for Probe<T> {
    fn schema(&self, _: &mut SchemaGenerator) -> Value {
        Value::Bool(true)
    }
}

/// Stands for a method's error type `E` in a method call that picks [`ErrorIsFramework`] for
/// `RpcError`, [`ErrorViaJsonSchema`] when `E` implements `JsonSchema` and [`ErrorViaAnyValue`]
/// otherwise; call it as `(&&&ErrorProbe::<E>::new()).error_schema(&mut generator)`.
pub struct ErrorProbe<T: ?Sized>(PhantomData<fn() -> Box<T>>);

impl<T: ?Sized> ErrorProbe<T> {
    /// The probe of `T`.
    pub const fn new() -> Self {
        ErrorProbe(PhantomData)
    }
}

impl<T: ?Sized> Default for ErrorProbe<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// The framework's own error: no typed error, so no schema.
pub trait ErrorIsFramework {
    /// `None`.
    fn error_schema(&self, generator: &mut SchemaGenerator) -> Option<Value>;
}

impl ErrorIsFramework for &&ErrorProbe<RpcError> {
    fn error_schema(&self, _: &mut SchemaGenerator) -> Option<Value> {
        None
    }
}

/// A typed error that implements `JsonSchema`: its schema.
pub trait ErrorViaJsonSchema {
    /// The error type's schema; named types are added to `generator`'s definitions.
    fn error_schema(&self, generator: &mut SchemaGenerator) -> Option<Value>;
}

impl<T: JsonSchema + ?Sized> ErrorViaJsonSchema for &ErrorProbe<T> {
    fn error_schema(&self, generator: &mut SchemaGenerator) -> Option<Value> {
        Some(generator.subschema_for::<T>().to_value())
    }
}

/// A typed error that does not implement `JsonSchema`: `true`, any value.
pub trait ErrorViaAnyValue {
    /// `Some(true)`.
    fn error_schema(&self, generator: &mut SchemaGenerator) -> Option<Value>;
}

impl<T: ?Sized> ErrorViaAnyValue for ErrorProbe<T> {
    fn error_schema(&self, _: &mut SchemaGenerator) -> Option<Value> {
        Some(Value::Bool(true))
    }
}

#[cfg(test)]
// The borrows pick the implementation: that is what is tested.
#[allow(clippy::needless_borrow)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A type with a schema.
    #[derive(JsonSchema)]
    #[allow(dead_code)]
    struct Order {
        id: u64,
        note: Option<String>,
    }

    /// A type without one.
    #[allow(dead_code)]
    struct Opaque(u8);

    #[test]
    fn a_type_with_json_schema_is_a_reference_to_its_object_schema() {
        let mut g = schema_generator();
        let schema = (&&Probe::<Order>::new()).schema(&mut g);
        assert_eq!(schema, json!({"$ref": "#/components/schemas/Order"}));
        // Inline types stay inline.
        let schema = (&&Probe::<bool>::new()).schema(&mut g);
        assert_eq!(schema, json!({"type": "boolean"}));
        let schemas = entry_schemas(g, vec![], Value::Bool(true), None);
        let order = &schemas.definitions["Order"];
        assert_eq!(order["type"], "object");
        assert_eq!(order["required"], json!(["id"]));
        assert_eq!(
            order["properties"]["id"],
            json!({"type": "integer", "format": "uint64", "minimum": 0})
        );
        assert_eq!(schemas.definitions.len(), 1, "{:?}", schemas.definitions);
    }

    #[test]
    fn a_type_without_json_schema_is_any_value() {
        let mut g = schema_generator();
        assert_eq!((&&Probe::<Opaque>::new()).schema(&mut g), Value::Bool(true));
        assert!(g.definitions().is_empty());
    }

    #[test]
    fn the_framework_error_has_no_schema_and_typed_errors_have_one() {
        let mut g = schema_generator();
        assert_eq!(
            (&&&ErrorProbe::<RpcError>::new()).error_schema(&mut g),
            None
        );
        assert_eq!(
            (&&&ErrorProbe::<Order>::new()).error_schema(&mut g),
            Some(json!({"$ref": "#/components/schemas/Order"}))
        );
        assert_eq!(
            (&&&ErrorProbe::<Opaque>::new()).error_schema(&mut g),
            Some(Value::Bool(true))
        );
        // Through a path or an alias it is the same type.
        type Alias = rpc_core::RpcError;
        assert_eq!((&&&ErrorProbe::<Alias>::new()).error_schema(&mut g), None);
    }
}
