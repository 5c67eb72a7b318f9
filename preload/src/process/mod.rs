//! The process-wide layer: environment settings, per-thread region settings, logging, the one
//! process-wide [`runtime::Runtime`], and the helpers every entry point of the FFI boundary
//! uses ([`boundary`]). It knows nothing of the entry points above it nor of the control server.

pub mod boundary;
pub mod env_names;
pub mod fork;
pub mod logging;
pub mod runtime;
pub mod settings;
