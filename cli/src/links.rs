//! `warren serve`'s links to other brokers: warren-links' supervisor, started beside the
//! listeners, plugged into the management side (parameter checks, `/api/shovels`,
//! `/api/bridges`, `warren_shovel_*` and `warren_bridge_*` metrics), with the config
//! file's `[[bridge]]` and `[[shovel]]` tables.

use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::watch;
use warren_links::Supervisor;
use warren_runtime::BrokerHandle;

struct Hook(Arc<Supervisor>);

impl warren_management::Links for Hook {
    fn validate(
        &self,
        component: &str,
        vhost: &str,
        name: &str,
        value: &serde_json::Value,
    ) -> Result<(), String> {
        self.0.validate(component, vhost, name, value)
    }

    fn changed(&self) {
        self.0.changed();
    }

    fn shovels(&self) -> Vec<serde_json::Value> {
        self.0.shovels()
    }

    fn bridges(&self) -> Vec<serde_json::Value> {
        self.0.bridges()
    }

    fn metrics(&self, out: &mut String) {
        self.0.metrics(out);
    }
}

/// Where a local shovel end and a bridge's local end connect: the first plain AMQP and
/// MQTT listeners (a wildcard address as loopback).
pub fn local(listeners: &[warren_management::Listener]) -> [Option<SocketAddr>; 2] {
    let first = |p| listeners.iter().find(|l| l.protocol == p).map(|l| l.addr);
    ["amqp", "mqtt"].map(|p| first(p).map(warren_links::loopback))
}

/// Starts the links and plugs them into `management`. On a cluster node, `leads` is "this
/// node leads the metadata group": the dynamic shovels run there only.
pub fn start(
    broker: BrokerHandle,
    management: &warren_management::Management,
    [amqp, mqtt]: [Option<SocketAddr>; 2],
    (node, leads): (String, Option<watch::Receiver<bool>>),
    tables: (warren_links::Bridges, warren_links::Shovels),
    stopped: watch::Receiver<bool>,
) {
    let local = warren_links::LocalBroker {
        amqp,
        mqtt,
        node,
        leads,
    };
    let supervisor = Supervisor::start(broker, local, tables, stopped);
    management.set_links(Arc::new(Hook(supervisor)));
}
