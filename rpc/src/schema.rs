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

use std::collections::{BTreeMap, BTreeSet};
use std::marker::PhantomData;

use rpc_core::{EntrySchemas, RpcError};
use schemars::generate::{SchemaGenerator, SchemaSettings};
use schemars::JsonSchema;
use serde_json::Value;

/// Where named schemas are referred to: an OpenAPI document's components, so that a gateway
/// can put the definitions there as they are.
pub const DEFINITIONS_PATH: &str = "#/components/schemas/";

/// The generator of one entry's parameter schemas: JSON Schema draft 2020-12 (as OpenAPI 3.1
/// uses), named types as references to `DEFINITIONS_PATH`, each type as the server reads it
/// (serde's deserialising contract: a field with a default or of an `Option` type may be left
/// out).
pub fn schema_generator() -> SchemaGenerator {
    SchemaSettings::draft2020_12()
        .with(|s| s.definitions_path = DEFINITIONS_PATH.into())
        .into_generator()
}

/// The generator of one entry's result and error schemas: as [`schema_generator`], each type as
/// the server writes it (serde's serialising contract: every field it sends is listed and
/// required, `skip_deserializing` ones included).
pub fn output_schema_generator() -> SchemaGenerator {
    SchemaSettings::draft2020_12()
        .for_serialize()
        .with(|s| s.definitions_path = DEFINITIONS_PATH.into())
        .into_generator()
}

/// One entry's schemas, with the definitions `inputs` (the parameters') and `outputs` (the
/// result's and the error's) collected while producing them, in one set: a type the server
/// writes otherwise than it reads (or that refers to one) has its written form under
/// `<name>.out`, which the result and error refer to.
pub fn entry_schemas(
    mut inputs: SchemaGenerator,
    mut outputs: SchemaGenerator,
    params: Vec<Value>,
    mut result: Value,
    mut error: Option<Value>,
) -> EntrySchemas {
    let mut definitions = inputs.take_definitions(true);
    let written = outputs.take_definitions(true);
    // Named alike in both but not the same schema, directly or through what it refers to.
    let mut apart: BTreeSet<String> = written
        .iter()
        .filter(|(name, schema)| definitions.get(*name).is_some_and(|read| read != *schema))
        .map(|(name, _)| name.clone())
        .collect();
    loop {
        let more: Vec<String> = written
            .iter()
            .filter(|(name, schema)| {
                !apart.contains(*name)
                    && definitions.contains_key(*name)
                    && references(schema).iter().any(|r| apart.contains(r))
            })
            .map(|(name, _)| name.clone())
            .collect();
        if more.is_empty() {
            break;
        }
        apart.extend(more);
    }
    let taken = |name: &str| definitions.contains_key(name) || written.contains_key(name);
    let rename: BTreeMap<String, String> = apart
        .into_iter()
        .map(|name| {
            let mut new = format!("{name}.out");
            let mut n = 2;
            while taken(&new) {
                new = format!("{name}.out{n}");
                n += 1;
            }
            (name, new)
        })
        .collect();
    for (name, mut schema) in written {
        rename_references(&mut schema, &rename);
        match rename.get(&name) {
            Some(new) => {
                definitions.insert(new.clone(), schema);
            }
            None => {
                definitions.entry(name).or_insert(schema);
            }
        }
    }
    rename_references(&mut result, &rename);
    if let Some(error) = error.as_mut() {
        rename_references(error, &rename);
    }
    EntrySchemas {
        params,
        result,
        error,
        definitions,
    }
}

/// The names of the definitions `schema` refers to (`$ref`s to `DEFINITIONS_PATH`).
fn references(schema: &Value) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![schema];
    while let Some(value) = stack.pop() {
        match value {
            Value::Object(map) => {
                for (key, v) in map {
                    match (key.as_str(), v) {
                        ("$ref", Value::String(r)) => {
                            if let Some(name) = r.strip_prefix(DEFINITIONS_PATH) {
                                found.push(name.to_string());
                            }
                        }
                        _ => stack.push(v),
                    }
                }
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    found
}

/// Rewrites the `$ref`s in `schema` to a definition `rename` names to its new name.
fn rename_references(schema: &mut Value, rename: &BTreeMap<String, String>) {
    if rename.is_empty() {
        return;
    }
    match schema {
        Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                match (key.as_str(), v) {
                    ("$ref", Value::String(r)) => {
                        let new = r
                            .strip_prefix(DEFINITIONS_PATH)
                            .and_then(|name| rename.get(name));
                        if let Some(new) = new {
                            *r = format!("{DEFINITIONS_PATH}{new}");
                        }
                    }
                    (_, v) => rename_references(v, rename),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| rename_references(v, rename)),
        _ => {}
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
        let schemas = entry_schemas(
            g,
            output_schema_generator(),
            vec![],
            Value::Bool(true),
            None,
        );
        let order = &schemas.definitions["Order"];
        assert_eq!(order["type"], "object");
        assert_eq!(order["required"], json!(["id"]));
        assert_eq!(
            order["properties"]["id"],
            json!({"type": "integer", "format": "uint64", "minimum": 0})
        );
        assert_eq!(schemas.definitions.len(), 1, "{:?}", schemas.definitions);
    }

    /// Written with a field it never reads.
    #[derive(JsonSchema, serde::Serialize, serde::Deserialize)]
    #[allow(dead_code)]
    struct Priced {
        id: u64,
        #[serde(skip_deserializing)]
        total: u64,
        note: Option<String>,
    }

    /// Refers to one written otherwise than read.
    #[derive(JsonSchema, serde::Serialize, serde::Deserialize)]
    #[allow(dead_code)]
    struct Basket {
        items: Vec<Priced>,
    }

    /// Written as read.
    #[derive(JsonSchema, serde::Serialize, serde::Deserialize)]
    #[allow(dead_code)]
    struct Plain {
        id: u64,
    }

    /// Parameters are described as the server reads them, the result and the error as it writes
    /// them: a type that differs (or refers to one that does) has both forms, the written one
    /// under `<name>.out`; one that does not is defined once.
    #[test]
    fn results_and_errors_are_described_as_written_and_parameters_as_read() {
        let (mut read, mut written) = (schema_generator(), output_schema_generator());
        let params = vec![
            (&&Probe::<Basket>::new()).schema(&mut read),
            (&&Probe::<Plain>::new()).schema(&mut read),
        ];
        let result = (&&Probe::<Basket>::new()).schema(&mut written);
        let error = (&&&ErrorProbe::<Plain>::new()).error_schema(&mut written);
        let schemas = entry_schemas(read, written, params, result, error);
        let d = &schemas.definitions;
        let mut names: Vec<&str> = d.keys().map(String::as_str).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            ["Basket", "Basket.out", "Plain", "Priced", "Priced.out"]
        );
        assert_eq!(d["Priced"]["required"], json!(["id"]));
        assert!(d["Priced"]["properties"].get("total").is_none());
        assert_eq!(d["Priced.out"]["required"], json!(["id", "total", "note"]));
        let path = DEFINITIONS_PATH;
        assert_eq!(
            d["Basket"]["properties"]["items"]["items"],
            json!({"$ref": format!("{path}Priced")})
        );
        assert_eq!(
            d["Basket.out"]["properties"]["items"]["items"],
            json!({"$ref": format!("{path}Priced.out")})
        );
        assert_eq!(schemas.params[0], json!({"$ref": format!("{path}Basket")}));
        assert_eq!(schemas.result, json!({"$ref": format!("{path}Basket.out")}));
        assert_eq!(schemas.error, Some(json!({"$ref": format!("{path}Plain")})));
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
