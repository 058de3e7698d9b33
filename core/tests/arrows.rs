//! Arrows that must never exist in the core, read from its source (ARCHITECTURE.md,
//! "warren-core", Architecture Invariant). Each file's module references (`crate::x`,
//! `super::x`, `use crate::{x, ..}`) give the arrows between the core's top-level modules:
//! - the mail names what the sides say to each other, so it depends on none of them;
//! - a side (`queue`, `channel`, `topology`) never depends on another side: what crosses
//!   goes by mail, and the composition is the only place that sees two sides;
//! - nothing depends on the one-shard composition (`shard`, also called `broker`) but the
//!   crate root and the multi-shard composition (`shards`), and nothing but the crate root
//!   on `shards`;
//! - no circle between top-level modules;
//! - the core stays sans-IO: no tokio, files, sockets, clocks or threads.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const SIDES: &[&str] = &["queue", "channel", "topology"];
const COMPOSITION: &[&str] = &["shard", "broker"];

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("core/src")
        .map(|e| e.expect("entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The file's text without comments (line comments, doc comments, block comments).
fn code(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let mut in_str = false;
        let mut prev = ' ';
        let mut cut = line.len();
        for (i, c) in line.char_indices() {
            if c == '"' && prev != '\\' {
                in_str = !in_str;
            }
            if !in_str && c == '/' && prev == '/' {
                cut = i - 1;
                break;
            }
            prev = c;
        }
        out.push_str(&line[..cut]);
        out.push('\n');
    }
    while let Some(start) = out.find("/*") {
        let end = out[start..].find("*/").map_or(out.len(), |e| start + e + 2);
        out.replace_range(start..end, "");
    }
    out
}

/// The top-level module a file belongs to (`None`: the crate root) and whether `super::`
/// in it means the crate root (a file directly under `src/`, or a `mod.rs` one level down).
fn area(rel: &Path) -> (Option<String>, bool) {
    let parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let stem = |s: &str| s.trim_end_matches(".rs").to_string();
    match parts.as_slice() {
        [f] if f == "lib.rs" => (None, true),
        [f] => (Some(stem(f)), true),
        [dir, f] => (Some(dir.clone()), f == "mod.rs"),
        [dir, ..] => (Some(dir.clone()), false),
        [] => (None, true),
    }
}

fn ident_at(s: &str) -> Option<String> {
    let id: String = s
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!id.is_empty()).then_some(id)
}

/// The top-level modules a file's code refers to.
fn references(code: &str, super_is_root: bool) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut prefixes = vec!["crate::"];
    if super_is_root {
        prefixes.push("super::");
    }
    for prefix in prefixes {
        for (i, _) in code.match_indices(prefix) {
            // `warren_core::crate::` never appears; skip `$crate::` in macros.
            if code[..i].ends_with('$') {
                continue;
            }
            let rest = &code[i + prefix.len()..];
            if let Some(group) = rest.strip_prefix('{') {
                // `use crate::{a::b, c, d::{e, f}}`: the first segment of each item.
                let mut depth = 0usize;
                let mut item_start = true;
                for (j, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => item_start = true,
                        c if c.is_whitespace() => {}
                        _ if item_start => {
                            item_start = false;
                            if let Some(id) = ident_at(&group[j..]) {
                                out.insert(id);
                            }
                        }
                        _ => {}
                    }
                }
            } else if let Some(id) = ident_at(rest) {
                out.insert(id);
            }
        }
    }
    out
}

/// (file, its area, the areas it refers to), for every core source file.
fn graph() -> Vec<(String, Option<String>, BTreeSet<String>, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let modules: BTreeSet<String> = files
        .iter()
        .filter_map(|p| area(p.strip_prefix(&src).expect("under src")).0)
        .collect();
    files
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(&src).expect("under src");
            let text = std::fs::read_to_string(p).expect("readable source");
            let code = code(&text);
            let (area, super_is_root) = area(rel);
            let refs = references(&code, super_is_root)
                .into_iter()
                // Items of the crate root (`crate::Broker`) are not modules.
                .filter(|m| modules.contains(m) || m == "broker")
                .filter(|m| Some(m) != area.as_ref())
                .collect();
            (rel.display().to_string(), area, refs, code)
        })
        .collect()
}

#[test]
fn no_forbidden_arrow_between_the_cores_modules() {
    let mut broken = Vec::new();
    for (file, area, refs, _) in graph() {
        let Some(area) = area else { continue };
        for to in &refs {
            let why = if area == "mail"
                && (SIDES.contains(&to.as_str())
                    || COMPOSITION.contains(&to.as_str())
                    || to == "shards")
            {
                Some("the mail depends on no side and no composition")
            } else if SIDES.contains(&area.as_str()) && SIDES.contains(&to.as_str()) {
                Some("a side never depends on another side")
            } else if COMPOSITION.contains(&to.as_str()) && area != "shards" {
                Some("only the crate root and `shards` depend on the shard composition")
            } else if to == "shards" {
                Some("only the crate root depends on `shards`")
            } else {
                None
            };
            if let Some(why) = why {
                broken.push(format!("{file} -> {to}: {why}"));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "forbidden arrows:\n{}",
        broken.join("\n")
    );
}

#[test]
fn no_circle_between_the_cores_modules() {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (_, area, refs, _) in graph() {
        if let Some(area) = area {
            edges.entry(area).or_default().extend(refs);
        }
    }
    // `broker` is `shard` under its old name.
    for targets in edges.values_mut() {
        if targets.remove("broker") {
            targets.insert("shard".into());
        }
    }
    // Depth-first search for a back edge, reporting the circle it closes.
    fn visit(
        n: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == n) {
            let mut circle = path[i..].to_vec();
            circle.push(n.to_string());
            return Some(circle);
        }
        if done.contains(n) {
            return None;
        }
        path.push(n.to_string());
        for m in edges.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, edges, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for n in edges.keys() {
        if let Some(circle) = visit(n, &edges, &mut Vec::new(), &mut done) {
            panic!("a circle between modules: {}", circle.join(" -> "));
        }
    }
}

#[test]
fn the_core_does_no_io_and_reads_no_clock() {
    let forbidden = [
        "tokio",
        "std::fs",
        "std::net",
        "std::thread",
        "std::time::Instant",
        "std::time::SystemTime",
        "Instant::now",
        "SystemTime::now",
        "std::process",
        "std::env",
    ];
    let mut found = Vec::new();
    for (file, _, _, code) in graph() {
        for f in forbidden {
            if code.contains(f) {
                found.push(format!("{file}: {f}"));
            }
        }
        // `use std::time::{Duration, Instant}` and the like.
        if let Some(i) = code.find("std::time::{")
            && code[i..]
                .split('}')
                .next()
                .is_some_and(|g| g.contains("Instant") || g.contains("SystemTime"))
        {
            found.push(format!("{file}: std::time clock"));
        }
    }
    assert!(
        found.is_empty(),
        "the core must stay sans-IO:\n{}",
        found.join("\n")
    );
}
