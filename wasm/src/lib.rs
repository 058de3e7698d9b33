//! `warren-wasm`: the broker core for WebAssembly hosts.
//!
//! This crate builds the unchanged `warren-core` state machine as a `cdylib` for
//! `wasm32-unknown-unknown`. The JS API (wasm-bindgen) and the C-ABI module for wasmtime hosts
//! are the WebAssembly issue's work and live here when they land; until then the crate only
//! proves, in CI, that the core links for wasm32 as a library.

pub use warren_core::{Broker, BrokerConfig};
