//! Crate-level arrows that must never exist (ARCHITECTURE.md), checked over the resolved
//! dependency graph `cargo metadata` prints:
//! - warren-core does no I/O: none of its normal dependencies, direct or transitive, is a
//!   runtime, socket, file-store or entropy crate (it must stay sans-IO and deterministic and
//!   build for wasm32-unknown-unknown);
//! - no gateway (a workspace crate under `gateway-*/`) depends on another gateway, directly or
//!   through another crate: each protocol stands alone on the runtime;
//! - no gateway names warren-store: storage is reached through the runtime only;
//! - warren-runtime depends on no gateway: protocols plug into the runtime, not the reverse.
//!
//! The module-level arrows inside the core are checked in the core's own tests.

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// Crates that do I/O, read clocks or entropy, or run an async runtime: never under the core.
const IO_CRATES: &[&str] = &[
    "tokio",
    "mio",
    "socket2",
    "redb",
    "async-std",
    "async-io",
    "smol",
    "polling",
    "hyper",
    "reqwest",
    "ureq",
    "memmap2",
    "nix",
    "rustix",
    "tempfile",
    "getrandom",
];

fn is_io_crate(name: &str) -> bool {
    IO_CRATES.contains(&name) || name.starts_with("tokio-")
}

/// One dependency edge: from a package to another, with the kinds it is declared as
/// (`None` for a normal dependency, `Some("dev")`, `Some("build")`).
struct Edge {
    to: String,
    kinds: Vec<Option<String>>,
}

/// The parts of `cargo metadata`'s output the arrows need.
struct Graph {
    /// Package id -> crate name.
    names: BTreeMap<String, String>,
    /// Package id -> its directory relative to the workspace root (workspace members only).
    members: BTreeMap<String, String>,
    edges: BTreeMap<String, Vec<Edge>>,
}

impl Graph {
    fn parse(metadata: &Value) -> Graph {
        let root = metadata["workspace_root"].as_str().expect("workspace_root");
        let member_ids: BTreeSet<&str> = metadata["workspace_members"]
            .as_array()
            .expect("workspace_members")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let mut names = BTreeMap::new();
        let mut members = BTreeMap::new();
        for p in metadata["packages"].as_array().expect("packages") {
            let id = p["id"].as_str().expect("package id").to_owned();
            let name = p["name"].as_str().expect("package name").to_owned();
            if member_ids.contains(id.as_str()) {
                let manifest = p["manifest_path"].as_str().expect("manifest_path");
                let dir = manifest
                    .strip_prefix(root)
                    .unwrap_or(manifest)
                    .trim_start_matches('/')
                    .trim_end_matches("Cargo.toml")
                    .trim_end_matches('/')
                    .to_owned();
                members.insert(id.clone(), dir);
            }
            names.insert(id, name);
        }
        let mut edges = BTreeMap::new();
        for node in metadata["resolve"]["nodes"]
            .as_array()
            .expect("resolve.nodes")
        {
            let from = node["id"].as_str().expect("node id").to_owned();
            let out = node["deps"]
                .as_array()
                .expect("node deps")
                .iter()
                .map(|d| Edge {
                    to: d["pkg"].as_str().expect("dep pkg").to_owned(),
                    kinds: d["dep_kinds"]
                        .as_array()
                        .expect("dep_kinds")
                        .iter()
                        .map(|k| k["kind"].as_str().map(str::to_owned))
                        .collect(),
                })
                .collect();
            edges.insert(from, out);
        }
        Graph {
            names,
            members,
            edges,
        }
    }

    fn id_of(&self, name: &str) -> Option<&str> {
        self.members
            .keys()
            .find(|id| self.names[*id] == name)
            .map(String::as_str)
    }

    fn gateways(&self) -> Vec<&str> {
        self.members
            .iter()
            .filter(|(_, dir)| dir.starts_with("gateway-") && !dir.contains('/'))
            .map(|(id, _)| id.as_str())
            .collect()
    }

    /// Every package reachable from `from` over normal dependencies, with the path to it
    /// (crate names), `from` excluded.
    fn normal_closure(&self, from: &str) -> BTreeMap<String, Vec<String>> {
        let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut stack = vec![(from.to_owned(), vec![self.names[from].clone()])];
        while let Some((id, path)) = stack.pop() {
            for e in self.edges.get(&id).map(Vec::as_slice).unwrap_or_default() {
                if !e.kinds.iter().any(Option::is_none) || seen.contains_key(&e.to) {
                    continue;
                }
                let mut p = path.clone();
                p.push(self.names[&e.to].clone());
                seen.insert(e.to.clone(), p.clone());
                stack.push((e.to.clone(), p));
            }
        }
        seen
    }

    /// Direct dependencies of `from` of any kind (normal, dev, build).
    fn direct(&self, from: &str) -> impl Iterator<Item = &str> {
        self.edges
            .get(from)
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .map(|e| e.to.as_str())
    }
}

/// Every forbidden arrow in `g`, one line each (empty: none).
fn violations(g: &Graph) -> Vec<String> {
    let mut found = Vec::new();
    let name = |id: &str| g.names[id].clone();
    // "a reaches b": over normal dependencies at any depth, or directly as any kind.
    let reaches = |a: &str, b: &str| -> Option<String> {
        if let Some(path) = g.normal_closure(a).get(b) {
            return Some(path.join(" -> "));
        }
        g.direct(a)
            .any(|d| d == b)
            .then(|| format!("{} -> {} (dev or build)", name(a), name(b)))
    };

    match g.id_of("warren-core") {
        Some(core) => {
            for (id, path) in g.normal_closure(core) {
                if is_io_crate(&g.names[&id]) {
                    found.push(format!("the core does no I/O: {}", path.join(" -> ")));
                }
            }
        }
        None => found.push("no warren-core in the workspace".to_owned()),
    }

    let gateways = g.gateways();
    if gateways.len() < 2 {
        found.push(format!(
            "expected the AMQP and MQTT gateways, found {gateways:?}"
        ));
    }
    for &a in &gateways {
        for &b in &gateways {
            if a != b
                && let Some(path) = reaches(a, b)
            {
                found.push(format!("a gateway depends on another gateway: {path}"));
            }
        }
    }

    if let Some(store) = g.id_of("warren-store") {
        for &gw in &gateways {
            if g.direct(gw).any(|d| d == store) {
                found.push(format!(
                    "a gateway reaches storage through the runtime only: {} -> warren-store",
                    name(gw)
                ));
            }
        }
    }

    match g.id_of("warren-runtime") {
        Some(runtime) => {
            for &gw in &gateways {
                if let Some(path) = reaches(runtime, gw) {
                    found.push(format!("the runtime depends on no gateway: {path}"));
                }
            }
        }
        None => found.push("no warren-runtime in the workspace".to_owned()),
    }
    found
}

/// `cargo metadata` of this workspace, resolved for the host (what this machine builds; no
/// other platform's crates need downloading).
fn workspace_metadata() -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let vv = Command::new(&rustc).arg("-vV").output().expect("rustc -vV");
    let vv = String::from_utf8(vv.stdout).expect("rustc -vV is UTF-8");
    let host = vv
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .expect("rustc -vV names the host");
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--filter-platform",
            host,
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON")
}

#[test]
fn no_forbidden_crate_arrows() {
    let g = Graph::parse(&workspace_metadata());
    let found = violations(&g);
    assert!(
        found.is_empty(),
        "forbidden dependency arrows:\n  {}",
        found.join("\n  ")
    );
}

/// The checker itself: a made-up workspace with each forbidden arrow is caught, one line per
/// arrow, and the same workspace without them passes.
/// A made-up dependency: from, to, kind (`None`: normal).
type Arrow<'a> = (&'a str, &'a str, Option<&'a str>);

#[test]
fn each_forbidden_arrow_is_reported() {
    fn pkg(name: &str, dir: Option<&str>) -> (String, Value) {
        let id = format!("id-{name}");
        let manifest = match dir {
            Some(d) => format!("/ws/{d}/Cargo.toml"),
            None => format!("/registry/{name}/Cargo.toml"),
        };
        (
            id.clone(),
            serde_json::json!({ "id": id, "name": name, "manifest_path": manifest }),
        )
    }
    fn metadata(arrows: &[Arrow<'_>]) -> Value {
        let packages = [
            pkg("warren-core", Some("core")),
            pkg("warren-runtime", Some("runtime")),
            pkg("warren-store", Some("store")),
            pkg("warren-amqp", Some("gateway-amqp")),
            pkg("warren-mqtt", Some("gateway-mqtt")),
            pkg("bytes", None),
            pkg("helper", None),
            pkg("mio", None),
        ];
        let members: Vec<&String> = packages
            .iter()
            .filter(|(_, p)| {
                p["manifest_path"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("/ws/"))
            })
            .map(|(id, _)| id)
            .collect();
        let nodes: Vec<Value> = packages
            .iter()
            .map(|(id, p)| {
                let deps: Vec<Value> = arrows
                    .iter()
                    .filter(|(from, _, _)| *from == p["name"])
                    .map(|(_, to, kind)| {
                        serde_json::json!({
                            "pkg": format!("id-{to}"),
                            "dep_kinds": [{ "kind": kind, "target": null }],
                        })
                    })
                    .collect();
                serde_json::json!({ "id": id, "deps": deps })
            })
            .collect();
        serde_json::json!({
            "workspace_root": "/ws",
            "workspace_members": members,
            "packages": packages.iter().map(|(_, p)| p.clone()).collect::<Vec<_>>(),
            "resolve": { "nodes": nodes },
        })
    }
    let allowed = [
        ("warren-core", "bytes", None),
        ("warren-runtime", "warren-core", None),
        ("warren-runtime", "warren-store", None),
        ("warren-amqp", "warren-runtime", None),
        ("warren-mqtt", "warren-runtime", None),
        ("warren-store", "helper", None),
        ("helper", "mio", None),
        // A dev-dependency of the core may do I/O (tests, benches).
        ("warren-core", "helper", Some("dev")),
    ];
    assert_eq!(
        violations(&Graph::parse(&metadata(&allowed))),
        Vec::<String>::new()
    );

    let cases: [(&[Arrow<'_>], &str); 6] = [
        (
            &[("bytes", "helper", None)],
            "warren-core -> bytes -> helper -> mio",
        ),
        (
            &[("warren-amqp", "warren-mqtt", None)],
            "warren-amqp -> warren-mqtt",
        ),
        (
            &[("warren-mqtt", "warren-amqp", Some("dev"))],
            "warren-mqtt -> warren-amqp (dev",
        ),
        (
            &[("warren-amqp", "warren-store", None)],
            "warren-amqp -> warren-store",
        ),
        (
            &[("warren-store", "warren-mqtt", None)],
            "warren-runtime -> warren-store -> warren-mqtt",
        ),
        (
            &[("warren-runtime", "warren-amqp", Some("build"))],
            "warren-runtime -> warren-amqp",
        ),
    ];
    for (extra, expected) in cases {
        let arrows: Vec<_> = allowed.iter().chain(extra).copied().collect();
        let found = violations(&Graph::parse(&metadata(&arrows)));
        assert!(
            found.iter().any(|f| f.contains(expected)),
            "{extra:?} should be reported as {expected:?}; got {found:?}"
        );
    }
}
