//! `warren-guest`: the unchanged `warren-core` as a WebAssembly module with a small C ABI, for
//! wasmtime and any other host that can call exports and read linear memory.
//!
//! The ABI (`docs/wasm-abi.md` has the byte-level encoding):
//!
//! | export | signature | what |
//! |---|---|---|
//! | `warren_abi_version` | `() -> u32` | [`ABI_VERSION`]; hosts refuse a module they do not know |
//! | `warren_alloc` | `(len: u32) -> ptr` | `len` bytes of guest memory for the host to write an op into |
//! | `warren_free` | `(ptr, len: u32)` | gives back a buffer from `warren_alloc` |
//! | `warren_broker_new` | `(seed: u64) -> broker` | a broker with the default config and this naming seed |
//! | `warren_broker_free` | `(broker)` | drops a broker |
//! | `warren_handle` | `(broker, now: u64, conn: u64, channel: u32, ptr, len: u32) -> i32` | decodes and applies one op; 0 ok, -1 undecodable op, -2 channel > 65535 |
//! | `warren_tick` | `(broker, now: u64)` | advances time with no op (timers fire) |
//! | `warren_next_deadline` | `(broker) -> u64` | when to tick next; `u64::MAX` for never |
//! | `warren_poll_effects` | `(broker) -> u32` | encodes the pending effects; returns the batch length |
//! | `warren_effects_ptr` | `(broker) -> ptr` | where that batch is; valid until the next call on `broker` |
//! | `warren_check_invariants` | `(broker) -> u32` | 0 when the core's invariants hold, else 1 |
//! | `warren_policy` | `(broker, now: u64, ptr, len: u32) -> i32` | decodes and applies a policy change; 0 applied, 1 refused, -1 undecodable |
//!
//! Everything a host can do goes through [`GuestBroker`], which also runs natively: a host can
//! feed the same op bytes to both and compare the effect bytes (the differential test in
//! `examples/wasmtime-host` does).

pub mod codec;
pub mod scenario;

use warren_core::effect::Effect;
use warren_core::ids::{ChannelRef, ConnId};
use warren_core::{Broker, BrokerConfig};

/// Version of the export set and the byte encoding. Bumped on any incompatible change.
pub const ABI_VERSION: u32 = 3;

/// Why [`GuestBroker::handle`] refused an op (the broker state is unchanged).
#[derive(Debug, thiserror::Error)]
pub enum HandleError {
    #[error("undecodable op: {0}")]
    Decode(#[from] codec::DecodeError),
    #[error("channel {0} out of range (0..=65535)")]
    Channel(u32),
}

impl HandleError {
    /// The status `warren_handle` returns for this error.
    pub fn status(&self) -> i32 {
        match self {
            HandleError::Decode(_) => -1,
            HandleError::Channel(_) => -2,
        }
    }
}

/// A broker behind the byte ABI: op bytes in, effect batch bytes out.
pub struct GuestBroker {
    broker: Broker,
    effects: Vec<Effect>,
    /// The last encoded batch; reused so steady-state polling does not allocate.
    out: Vec<u8>,
}

impl GuestBroker {
    pub fn new(seed: u64) -> GuestBroker {
        GuestBroker {
            broker: Broker::new(BrokerConfig {
                seed,
                ..BrokerConfig::default()
            }),
            effects: Vec::new(),
            out: Vec::new(),
        }
    }

    /// Decodes `op` and applies it on channel (`conn`, `channel`) at `now`.
    pub fn handle(
        &mut self,
        now: u64,
        conn: u64,
        channel: u32,
        op: &[u8],
    ) -> Result<(), HandleError> {
        let channel = u16::try_from(channel).map_err(|_| HandleError::Channel(channel))?;
        let op = codec::decode_op(op)?;
        self.broker
            .handle(now, ChannelRef::new(ConnId(conn), channel), op);
        Ok(())
    }

    /// Decodes a policy change (`codec::encode_policy`) and applies it at `now`: `Ok(true)`
    /// applied, `Ok(false)` refused (an invalid or unknown policy; the broker is unchanged).
    pub fn policy(&mut self, now: u64, change: &[u8]) -> Result<bool, HandleError> {
        let applied = match codec::decode_policy(change)? {
            codec::PolicyChange::Set(def) => self.broker.set_policy(now, def),
            codec::PolicyChange::Clear { vhost, name } => {
                self.broker.clear_policy(now, &vhost, &name)
            }
        };
        Ok(applied.is_ok())
    }

    /// Advances time without an op: timers (message TTL, queue expiry, in cores that have
    /// them) fire here. Effects are polled as usual.
    pub fn tick(&mut self, now: u64) {
        self.broker.tick(now);
    }

    /// When the host should call [`GuestBroker::tick`] next (`u64::MAX`: no timer pending).
    pub fn next_deadline(&self) -> u64 {
        self.broker.next_deadline().unwrap_or(u64::MAX)
    }

    /// Encodes every pending effect as one batch and returns it.
    pub fn poll_effects(&mut self) -> &[u8] {
        self.broker.poll_effects(&mut self.effects);
        self.out.clear();
        codec::encode_effects(&self.effects, &mut self.out);
        self.effects.clear();
        &self.out
    }

    /// The core's own consistency check (counters, conservation, flow control bookkeeping).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.broker.check_invariants()
    }
}

#[cfg(target_arch = "wasm32")]
mod exports {
    //! The C ABI. Only built for wasm32: natively these symbols would only shadow nothing and
    //! invite calling raw pointers from Rust.

    use super::{ABI_VERSION, GuestBroker};
    use std::alloc::{Layout, alloc, dealloc};

    #[unsafe(no_mangle)]
    pub extern "C" fn warren_abi_version() -> u32 {
        ABI_VERSION
    }

    /// A zero-length request gets a dangling, non-null pointer that `warren_free` ignores.
    #[unsafe(no_mangle)]
    pub extern "C" fn warren_alloc(len: u32) -> *mut u8 {
        match Layout::array::<u8>(len as usize) {
            Ok(layout) if layout.size() > 0 => {
                // SAFETY: the layout has a non-zero size.
                let p = unsafe { alloc(layout) };
                if p.is_null() {
                    std::alloc::handle_alloc_error(layout);
                }
                p
            }
            _ => std::ptr::NonNull::<u8>::dangling().as_ptr(),
        }
    }

    /// # Safety
    /// `ptr` and `len` come from one `warren_alloc` call and are freed once.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn warren_free(ptr: *mut u8, len: u32) {
        if let Ok(layout) = Layout::array::<u8>(len as usize)
            && layout.size() > 0
        {
            // SAFETY: per the contract, allocated by `warren_alloc` with this layout.
            unsafe { dealloc(ptr, layout) }
        }
    }

    #[unsafe(no_mangle)]
    pub extern "C" fn warren_broker_new(seed: u64) -> *mut GuestBroker {
        Box::into_raw(Box::new(GuestBroker::new(seed)))
    }

    /// # Safety
    /// `b` comes from `warren_broker_new` and is not used afterwards.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn warren_broker_free(b: *mut GuestBroker) {
        if !b.is_null() {
            // SAFETY: per the contract.
            drop(unsafe { Box::from_raw(b) });
        }
    }

    /// # Safety
    /// `b` is a live broker; `ptr..ptr+len` is readable guest memory.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn warren_handle(
        b: *mut GuestBroker,
        now: u64,
        conn: u64,
        channel: u32,
        ptr: *const u8,
        len: u32,
    ) -> i32 {
        // SAFETY: per the contract.
        let (b, op) = unsafe { (&mut *b, std::slice::from_raw_parts(ptr, len as usize)) };
        match b.handle(now, conn, channel, op) {
            Ok(()) => 0,
            Err(e) => e.status(),
        }
    }

    /// # Safety
    /// `b` is a live broker; `ptr..ptr+len` is readable guest memory.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn warren_policy(
        b: *mut GuestBroker,
        now: u64,
        ptr: *const u8,
        len: u32,
    ) -> i32 {
        // SAFETY: per the contract.
        let (b, change) = unsafe { (&mut *b, std::slice::from_raw_parts(ptr, len as usize)) };
        match b.policy(now, change) {
            Ok(true) => 0,
            Ok(false) => 1,
            Err(e) => e.status(),
        }
    }

    /// # Safety
    /// `b` is a live broker.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn warren_tick(b: *mut GuestBroker, now: u64) {
        // SAFETY: per the contract.
        unsafe { (*b).tick(now) }
    }

    /// # Safety
    /// `b` is a live broker.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn warren_next_deadline(b: *const GuestBroker) -> u64 {
        // SAFETY: per the contract.
        unsafe { (*b).next_deadline() }
    }

    /// # Safety
    /// `b` is a live broker.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn warren_poll_effects(b: *mut GuestBroker) -> u32 {
        // SAFETY: per the contract. wasm32 memory is < 4 GiB, so the length fits.
        unsafe { (*b).poll_effects().len() as u32 }
    }

    /// # Safety
    /// `b` is a live broker.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn warren_effects_ptr(b: *mut GuestBroker) -> *const u8 {
        // SAFETY: per the contract.
        unsafe { (*b).out.as_ptr() }
    }

    /// # Safety
    /// `b` is a live broker.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn warren_check_invariants(b: *const GuestBroker) -> u32 {
        // SAFETY: per the contract.
        u32::from(unsafe { (*b).check_invariants() }.is_err())
    }
}
