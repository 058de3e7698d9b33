//! The calls `wasm/js/persist.js` makes on a broker opened with `Broker.open({ persist })`:
//! hidden from the TypeScript types (the JS class around them is the API). The store itself
//! is `idb_store.rs`; the byte format `record.rs`.

use super::{Broker, CONTROL, Inner, Persist, Res};
use crate::convert::{self, err};
use crate::idb_store;
use js_sys::{Array, Function};
use warren_core::{Broker as Core, BrokerConfig};
use wasm_bindgen::prelude::*;

impl Inner {
    fn persist(&self) -> Res<&Persist> {
        self.persist
            .as_ref()
            .ok_or_else(|| err("not a persistent broker (Broker.open)"))
    }

    /// Applies a store event to the core, then pumps (confirms go out, the next sync starts).
    fn store_event(&mut self, f: impl FnOnce(&mut Core, u64)) -> Res<()> {
        self.persist()?;
        let now = self.now;
        f(&mut self.core, now);
        self.pump(CONTROL).map(|_| ()).map_err(err)
    }
}

#[wasm_bindgen]
impl Broker {
    /// Replaces this fresh broker's core with one whose store is filled from `records` (put
    /// ops of every stored record, `idb_store.rs`) and whose changes go to
    /// `hook([epoch, batch])`. Returns [count of skipped records, ["key: reason", ...],
    /// [definition, ...]]: the definitions (decoded messages with their `kind`, in replay
    /// order) for `persist.js` to replay through the API before `_restored`.
    #[wasm_bindgen(js_name = _persist, skip_typescript)]
    pub fn persist_open(&self, records: &[u8], hook: Function, seed: Option<f64>) -> Res<Array> {
        let r = idb_store::restore(records).map_err(|e| err(format!("store: {e}")))?;
        let config = BrokerConfig {
            seed: seed.map_or(BrokerConfig::default().seed, |s| s as u64),
            ..BrokerConfig::default()
        };
        let definitions: Array = r
            .definitions
            .iter()
            .map(|(kind, m)| {
                let o = convert::message_to_js(m, None, None, None);
                let _ = js_sys::Reflect::set(&o, &"kind".into(), &JsValue::from(*kind));
                o
            })
            .collect();
        let skipped: Array = r.skipped.iter().map(|s| JsValue::from_str(s)).collect();
        self.with(|i| {
            i.core = Core::with_store(config, Box::new(r.store));
            i.persist = Some(Persist {
                shared: r.shared,
                hook,
                seq: 0,
                base: 0,
                confirms: Vec::new(),
            });
            i.reconnect();
            i.pump(CONTROL).map(|_| ()).map_err(err)
        })?;
        Ok(Array::of3(
            &JsValue::from_f64(r.skipped_count as f64),
            &skipped,
            &definitions,
        ))
    }

    /// The definitions are replayed: changes are written from now on, starting with a sync
    /// that ends the store's recovery (the core's contract).
    #[wasm_bindgen(js_name = _restored, skip_typescript)]
    pub fn persist_restored(&self) -> Res<()> {
        self.with(|i| {
            idb_store::restored(&i.persist()?.shared);
            i.core.request_sync();
            i.store_event(|_, _| {})
        })
    }

    /// Sets a retained message without publishing it (a restore's replay).
    #[wasm_bindgen(js_name = _retain, skip_typescript)]
    pub fn persist_retain(&self, topic: &str, payload: JsValue) -> Res<()> {
        self.with(|i| i.retain(topic, &payload))
    }

    /// The transaction of `epoch` committed.
    #[wasm_bindgen(js_name = _synced, skip_typescript)]
    pub fn persist_synced(&self, epoch: f64) -> Res<()> {
        self.with(|i| {
            let e = epoch as u64;
            idb_store::lock(&i.persist()?.shared).committed(e);
            i.store_event(|c, now| c.synced(now, e))
        })
    }

    /// The transaction of `epoch` failed (quota): its confirms become nacks, and its writes
    /// wait for `_resume` to be tried again.
    #[wasm_bindgen(js_name = _syncFailed, skip_typescript)]
    pub fn persist_failed(&self, epoch: f64) -> Res<()> {
        self.with(|i| {
            let e = epoch as u64;
            idb_store::lock(&i.persist()?.shared).failed(e);
            i.store_event(|c, now| c.sync_failed(now, e))
        })
    }

    /// Writes again after a failure.
    #[wasm_bindgen(js_name = _resume, skip_typescript)]
    pub fn persist_resume(&self) -> Res<()> {
        self.with(|i| {
            idb_store::lock(&i.persist()?.shared).paused = false;
            i.store_event(|_, _| {})
        })
    }

    /// Confirms since the last call: id (ack), -id (nack), `0, base` (the channel was
    /// reset: no confirm will come for the ids up to `base`).
    #[wasm_bindgen(js_name = _takeConfirms, skip_typescript)]
    pub fn persist_confirms(&self) -> Vec<f64> {
        self.inner
            .borrow_mut()
            .persist
            .as_mut()
            .map(|p| std::mem::take(&mut p.confirms))
            .unwrap_or_default()
    }

    /// The id of the last publish (its confirm's, in `_takeConfirms`).
    #[wasm_bindgen(getter, js_name = _publishSeq, skip_typescript)]
    pub fn persist_seq(&self) -> f64 {
        self.inner
            .borrow()
            .persist
            .as_ref()
            .map_or(0.0, |p| (p.base + p.seq) as f64)
    }

    /// The epoch whose commit makes every change so far durable (`undefined`: all are); the
    /// sync that covers them is started if none runs.
    #[wasm_bindgen(js_name = _unsyncedEpoch, skip_typescript)]
    pub fn persist_unsynced(&self) -> Res<Option<f64>> {
        self.with(|i| {
            if !idb_store::lock(&i.persist()?.shared).is_empty() {
                i.core.request_sync();
            }
            i.store_event(|_, _| {})?;
            Ok(i.core.unsynced_epoch().map(|e| e as f64))
        })
    }
}
