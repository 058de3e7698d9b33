//! `warren-mqtt`: the MQTT 3.1.1 / 5.0 gateway over `warren-core`.
//!
//! Reserved by the workspace layout; the gateway itself is the MQTT issue's work. Until it
//! lands, `warren serve --mqtt ADDR` logs that MQTT is unavailable in this build.
