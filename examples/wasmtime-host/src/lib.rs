//! A wasmtime host for the `warren-guest` module: loads the `.wasm`, and drives a broker in it
//! through the C ABI documented in `docs/wasm-abi.md`, with the same byte encoding as the
//! native `warren_guest::GuestBroker`.

use std::path::{Path, PathBuf};
use wasmtime::{Engine, Instance, Memory, Module, Store, TypedFunc};

/// What can go wrong hosting the module.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("reading {path}: {source} (build it with: {BUILD_GUEST})")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Compilation, instantiation, a missing export or a trap inside the guest.
    #[error("wasm: {0:#}")]
    Wasm(#[from] wasmtime::Error),
    #[error("the module speaks ABI version {0}, this host {ABI}", ABI = warren_guest::ABI_VERSION)]
    AbiVersion(u32),
    #[error("the module has no exported memory")]
    NoMemory,
    #[error("guest returned out-of-bounds buffer {ptr:#x}+{len}")]
    OutOfBounds { ptr: u32, len: u32 },
}

/// How to build the module this crate loads.
pub const BUILD_GUEST: &str =
    "cargo build -p warren-guest --target wasm32-unknown-unknown --release";

/// Where the module is: `$WARREN_GUEST_WASM`, else the workspace's release build output.
pub fn guest_wasm_path() -> PathBuf {
    match std::env::var_os("WARREN_GUEST_WASM") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../target/wasm32-unknown-unknown/release/warren_guest.wasm"),
    }
}

/// The compiled module: compile once (the slow part), instantiate per broker.
pub struct GuestModule {
    engine: Engine,
    module: Module,
}

impl GuestModule {
    pub fn load(path: &Path) -> Result<GuestModule, HostError> {
        let wasm = std::fs::read(path).map_err(|source| HostError::Read {
            path: path.to_owned(),
            source,
        })?;
        let engine = Engine::default();
        let module = Module::new(&engine, wasm)?;
        Ok(GuestModule { engine, module })
    }

    /// A fresh instance (its own linear memory) holding one broker seeded with `seed`.
    pub fn instantiate(&self, seed: u64) -> Result<WasmBroker, HostError> {
        let mut store = Store::new(&self.engine, ());
        // The guest imports nothing: it is pure computation over its own memory.
        let instance = Instance::new(&mut store, &self.module, &[])?;
        let version: TypedFunc<(), u32> =
            instance.get_typed_func(&mut store, "warren_abi_version")?;
        let v = version.call(&mut store, ())?;
        if v != warren_guest::ABI_VERSION {
            return Err(HostError::AbiVersion(v));
        }
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or(HostError::NoMemory)?;
        let new: TypedFunc<u64, u32> = instance.get_typed_func(&mut store, "warren_broker_new")?;
        let broker = new.call(&mut store, seed)?;
        Ok(WasmBroker {
            alloc: instance.get_typed_func(&mut store, "warren_alloc")?,
            free: instance.get_typed_func(&mut store, "warren_free")?,
            handle: instance.get_typed_func(&mut store, "warren_handle")?,
            poll: instance.get_typed_func(&mut store, "warren_poll_effects")?,
            effects_ptr: instance.get_typed_func(&mut store, "warren_effects_ptr")?,
            check: instance.get_typed_func(&mut store, "warren_check_invariants")?,
            tick: instance.get_typed_func(&mut store, "warren_tick")?,
            deadline: instance.get_typed_func(&mut store, "warren_next_deadline")?,
            policy: instance.get_typed_func(&mut store, "warren_policy")?,
            store,
            memory,
            broker,
            op_buf: 0,
            op_cap: 0,
        })
    }
}

/// One broker inside one module instance.
pub struct WasmBroker {
    store: Store<()>,
    memory: Memory,
    broker: u32,
    alloc: TypedFunc<u32, u32>,
    free: TypedFunc<(u32, u32), ()>,
    handle: TypedFunc<(u32, u64, u64, u32, u32, u32), i32>,
    poll: TypedFunc<u32, u32>,
    effects_ptr: TypedFunc<u32, u32>,
    check: TypedFunc<u32, u32>,
    tick: TypedFunc<(u32, u64), ()>,
    deadline: TypedFunc<u32, u64>,
    policy: TypedFunc<(u32, u64, u32, u32), i32>,
    /// Guest buffer the op bytes are copied into; grown as needed, reused across calls.
    op_buf: u32,
    op_cap: u32,
}

impl WasmBroker {
    /// Applies one encoded op. Returns the guest's status: 0 applied, -1 undecodable op,
    /// -2 channel out of range (the same as `GuestBroker::handle`'s `HandleError::status`).
    pub fn handle(
        &mut self,
        now: u64,
        conn: u64,
        channel: u32,
        op: &[u8],
    ) -> Result<i32, HostError> {
        let len = self.write_input(op)?;
        Ok(self.handle.call(
            &mut self.store,
            (self.broker, now, conn, channel, self.op_buf, len),
        )?)
    }

    /// Applies one encoded policy change (`codec::encode_policy`). Returns the guest's
    /// status: 0 applied, 1 refused, -1 undecodable (as `GuestBroker::policy`).
    pub fn policy(&mut self, now: u64, change: &[u8]) -> Result<i32, HostError> {
        let len = self.write_input(change)?;
        Ok(self
            .policy
            .call(&mut self.store, (self.broker, now, self.op_buf, len))?)
    }

    /// Copies `input` into the guest's input buffer (grown as needed); returns its length.
    fn write_input(&mut self, op: &[u8]) -> Result<u32, HostError> {
        let len = u32::try_from(op.len()).map_err(|_| HostError::OutOfBounds {
            ptr: 0,
            len: u32::MAX,
        })?;
        if len > self.op_cap {
            if self.op_cap > 0 {
                self.free
                    .call(&mut self.store, (self.op_buf, self.op_cap))?;
            }
            let cap = len.next_power_of_two().max(256);
            self.op_buf = self.alloc.call(&mut self.store, cap)?;
            self.op_cap = cap;
        }
        self.memory
            .write(&mut self.store, self.op_buf as usize, op)
            .map_err(|_| HostError::OutOfBounds {
                ptr: self.op_buf,
                len,
            })?;
        Ok(len)
    }

    /// Appends the pending effect batch (encoded by the guest) to `out`.
    pub fn poll_effects(&mut self, out: &mut Vec<u8>) -> Result<(), HostError> {
        let len = self.poll.call(&mut self.store, self.broker)?;
        let ptr = self.effects_ptr.call(&mut self.store, self.broker)?;
        let data = self.memory.data(&self.store);
        let bytes = (ptr as usize)
            .checked_add(len as usize)
            .and_then(|end| data.get(ptr as usize..end))
            .ok_or(HostError::OutOfBounds { ptr, len })?;
        out.extend_from_slice(bytes);
        Ok(())
    }

    /// Advances time with no op (timers fire; poll for their effects).
    pub fn tick(&mut self, now: u64) -> Result<(), HostError> {
        Ok(self.tick.call(&mut self.store, (self.broker, now))?)
    }

    /// When to tick next (`u64::MAX`: never).
    pub fn next_deadline(&mut self) -> Result<u64, HostError> {
        Ok(self.deadline.call(&mut self.store, self.broker)?)
    }

    /// Whether the core's invariants hold inside the guest.
    pub fn invariants_hold(&mut self) -> Result<bool, HostError> {
        Ok(self.check.call(&mut self.store, self.broker)? == 0)
    }

    /// Guest linear memory in bytes (for reports).
    pub fn memory_size(&self) -> usize {
        self.memory.data_size(&self.store)
    }
}
