//! No import circles between the modules of the AMQP and MQTT gateway crates: a part
//! must not import the composition built on it (issue 25). Reads each module's source,
//! collects the modules it names through `crate::` and `super::` paths, and fails on any
//! cycle, naming it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path ("session::content") -> source text, for every `.rs` file under `src`.
fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src dir") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src");
            let mut parts: Vec<String> = rel
                .with_extension("")
                .iter()
                .map(|p| p.to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            let name = parts.join("::");
            if name == "lib" || name == "main" {
                // The crate root re-exports its modules; it is not a part of the graph.
                continue;
            }
            out.insert(name, std::fs::read_to_string(&path).expect("read module"));
        }
    }
    out
}

/// The longest known module that `path` (segments after `crate::`) starts with.
fn resolve(known: &BTreeMap<String, String>, segments: &[&str]) -> Option<String> {
    (1..=segments.len())
        .rev()
        .map(|n| segments[..n].join("::"))
        .find(|m| known.contains_key(m))
}

/// Which modules each module names. Test modules inside a file (`#[cfg(test)]` and after) are
/// left out: they may reach anywhere.
fn edges(known: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph = BTreeMap::new();
    for (name, text) in known {
        let mut to = BTreeSet::new();
        let parent: Vec<&str> = name.split("::").collect();
        let parent = &parent[..parent.len() - 1];
        for line in text.lines() {
            let line = line.trim();
            if line.starts_with("#[cfg(test)]") {
                break;
            }
            if line.starts_with("//") {
                continue;
            }
            for (prefix, base) in [("crate::", &[][..]), ("super::", parent)] {
                let mut rest = line;
                while let Some(i) = rest.find(prefix) {
                    // Skip identifiers that merely end in the prefix (`my_crate::`).
                    let before = rest[..i].chars().last();
                    rest = &rest[i + prefix.len()..];
                    if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                        continue;
                    }
                    let mut segs: Vec<&str> = base.to_vec();
                    segs.extend(
                        rest.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                            .next()
                            .unwrap_or("")
                            .split("::")
                            .filter(|s| !s.is_empty()),
                    );
                    // `use crate::{a, b}` names several modules.
                    if rest.starts_with('{') {
                        let group = &rest[1..rest.find('}').unwrap_or(rest.len())];
                        for item in group.split(',') {
                            let mut s = segs.clone();
                            s.extend(item.trim().split("::").filter(|s| !s.is_empty()));
                            to.extend(resolve(known, &s));
                        }
                    } else {
                        to.extend(resolve(known, &segs));
                    }
                }
            }
        }
        to.remove(name);
        graph.insert(name.clone(), to);
    }
    graph
}

/// Every cycle, each reported once from its smallest module.
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    fn walk(
        graph: &BTreeMap<String, BTreeSet<String>>,
        start: &str,
        path: &mut Vec<String>,
        found: &mut Vec<Vec<String>>,
    ) {
        let Some(last) = path.last().cloned() else {
            return;
        };
        for next in graph.get(&last).into_iter().flatten() {
            if next == start {
                let mut c = path.clone();
                c.push(start.to_string());
                found.push(c);
            } else if next.as_str() > start && !path.contains(next) {
                path.push(next.clone());
                walk(graph, start, path, found);
                path.pop();
            }
        }
    }
    let mut found = Vec::new();
    for start in graph.keys() {
        walk(graph, start, &mut vec![start.clone()], &mut found);
    }
    found
}

fn check(crate_dir: &str) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(crate_dir)
        .join("src");
    let known = modules(&src);
    assert!(known.len() > 3, "no modules found under {}", src.display());
    let graph = edges(&known);
    let found = cycles(&graph);
    assert!(
        found.is_empty(),
        "import circles in {crate_dir}: {}",
        found
            .iter()
            .map(|c| c.join(" -> "))
            .collect::<Vec<_>>()
            .join("; ")
    );
}

#[test]
fn gateway_amqp_has_no_import_circle() {
    check(".");
}

#[test]
fn gateway_mqtt_has_no_import_circle() {
    check("../gateway-mqtt");
}

#[test]
fn gateway_stream_has_no_import_circle() {
    check("../gateway-stream");
}

#[test]
fn a_circle_is_found() {
    let known: BTreeMap<String, String> = [
        ("a", "use crate::b::X;"),
        ("b", "fn f() { crate::c::g() }"),
        ("c", "use crate::{a, d};"),
        ("d", "#[cfg(test)]\nuse crate::a;"),
        ("e::f", "use super::g::Y;"),
        ("e::g", "use crate::e::f;"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let found = cycles(&edges(&known));
    let shown: Vec<String> = found.iter().map(|c| c.join(" -> ")).collect();
    assert_eq!(shown, ["a -> b -> c -> a", "e::f -> e::g -> e::f"]);
}
