//! Integration tests live in `tests/tests/`.
//!
//! This library holds what the tests share with the helper programs of this package
//! (`src/bin/`), which the tests start as separate processes.

pub mod chaos;
pub mod parent;
pub mod shunt;
pub mod signals;
pub mod who;
