//! The arrows of the house (issue 37): `cli/` is the composition root only.
//!
//! - No `static` in `cli/src` holds runtime state (a `OnceLock`, `Mutex`, `RwLock`,
//!   `Atomic*`, `LazyLock`, a `Cell`, a `static mut`, `thread_local!`): what the binary runs
//!   is a value it made and passed in, so a test can make several. Constants are fine, and so
//!   is a stateless global allocator (its counters live in warren-runtime).
//! - `cli/src` stays at most [`CLI_MAX_LINES`] lines.
//! - No import circle between the files of the crates the cluster move touched (`cli`,
//!   `member`, `stream-backends`): read from their `crate::`, `super::` and child-module
//!   paths, test modules left out.
//!
//! Each checker is also run on a small bad sample, so the test fails if a checker stops
//! finding what it looks for.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The most lines `cli/src` may hold (issue 37: the binary is the composition root).
const CLI_MAX_LINES: usize = 4500;

/// Types whose statics hold state that changes at run time.
const STATEFUL: &[&str] = &[
    "OnceLock", "OnceCell", "Mutex", "RwLock", "Atomic", "LazyLock", "LazyCell", "Lazy<", "Cell<",
    "RefCell", "Condvar", "Barrier",
];

/// Macros that make process-global or thread-global state.
const STATEFUL_MACROS: &[&str] = &["thread_local!", "lazy_static!"];

/// Crates whose files must form no import circle (their directories, from the workspace).
const ACYCLIC: &[&str] = &["cli", "member", "stream-backends"];

/// The workspace, or `WARREN_ARROWS_ROOT` (another checkout, to measure it).
fn workspace() -> PathBuf {
    if let Some(root) = std::env::var_os("WARREN_ARROWS_ROOT") {
        return PathBuf::from(root);
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("cli has a parent directory")
        .to_path_buf()
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|x| x == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The code of `text` without `//` comments (doc comments included) and without string
/// literals' contents (a `//` or a `crate::` inside a string is no code). Lines stay lines.
fn code(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    let mut prev = '\0';
    while let Some(c) = chars.next() {
        if c == '/' && chars.peek() == Some(&'/') {
            // To the end of the line (the newline stays).
            while chars.peek().is_some_and(|&n| n != '\n') {
                chars.next();
            }
            continue;
        }
        // A string, but not the char literal '"'.
        if c == '"' && prev != '\'' {
            out.push('"');
            let mut escaped = false;
            for s in chars.by_ref() {
                if s == '\n' {
                    out.push('\n');
                }
                if escaped {
                    escaped = false;
                } else if s == '\\' {
                    escaped = true;
                } else if s == '"' {
                    break;
                }
            }
            out.push('"');
            prev = '"';
            continue;
        }
        out.push(c);
        prev = c;
    }
    out
}

/// `code` up to its `#[cfg(test)] mod tests` (the unit tests are no part of the arrows).
fn without_tests(code: &str) -> &str {
    let mut at = 0;
    while let Some(i) = code[at..].find("#[cfg(test)]") {
        let start = at + i;
        let rest = code[start + "#[cfg(test)]".len()..].trim_start();
        if rest.starts_with("mod tests") {
            return &code[..start];
        }
        at = start + 1;
    }
    code
}

/// The statics and macros of `code` that hold runtime state, as their text.
fn stateful_statics(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    let bytes = code.as_bytes();
    let mut at = 0;
    while let Some(i) = code[at..].find("static") {
        let start = at + i;
        at = start + "static".len();
        let before = start.checked_sub(1).map(|b| bytes[b]);
        let after = bytes.get(at).copied();
        let word_start = before.is_none_or(|b| !(b.is_ascii_alphanumeric() || b == b'_'));
        // `'static` is a lifetime, not an item.
        if !word_start || before == Some(b'\'') || !after.is_some_and(|a| a.is_ascii_whitespace()) {
            continue;
        }
        let end = code[at..].find(['=', ';']).map_or(code.len(), |e| at + e);
        let item = code[start..end].trim();
        // An item is `static NAME: TYPE`; anything else (a word in a string) is not.
        if !item.contains(':') {
            continue;
        }
        let ty = item.split_once(':').map_or("", |(_, t)| t);
        if item.starts_with("static mut") || STATEFUL.iter().any(|s| ty.contains(s)) {
            found.push(item.split_whitespace().collect::<Vec<_>>().join(" "));
        }
    }
    for m in STATEFUL_MACROS {
        if code.contains(m) {
            found.push((*m).to_string());
        }
    }
    found
}

/// A crate's modules: module path (`""` the root, `a::b`) -> its code without tests.
fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for file in rust_files(src) {
        let rel = file.strip_prefix(src).expect("under src");
        let mut parts: Vec<String> = rel
            .iter()
            .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
            .collect();
        if parts
            .last()
            .is_some_and(|l| l == "mod" || l == "lib" || l == "main")
        {
            parts.pop();
        }
        // Binaries under src/bin/ are crates of their own.
        if parts.first().is_some_and(|p| p == "bin") {
            continue;
        }
        out.insert(
            parts.join("::"),
            without_tests(&code(&read(&file))).to_string(),
        );
    }
    out
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The longest known module that `path` (a module path from the root) starts with.
fn resolve(known: &BTreeMap<String, String>, path: &[&str]) -> String {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| known.contains_key(m))
        .unwrap_or_default()
}

/// The paths after `prefix` (`crate::`, `super::` or `name::`) in `code`, each as its
/// segments; a group `prefix{a::x, b}` gives one path per member.
fn paths_after<'a>(code: &'a str, prefix: &str) -> Vec<Vec<&'a str>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let mut at = 0;
    while let Some(i) = code[at..].find(prefix) {
        let start = at + i;
        at = start + prefix.len();
        // The whole word: not `other_crate::` nor `a::crate::`.
        if start > 0 {
            let b = bytes[start - 1];
            if b.is_ascii_alphanumeric() || b == b'_' || b == b':' {
                continue;
            }
        }
        let rest = &code[at..];
        if let Some(group) = rest.strip_prefix('{') {
            let inner = &group[..group.find('}').unwrap_or(group.len())];
            for member in inner.split(',') {
                let segs: Vec<&str> = member.trim().split("::").map(ident).collect();
                if segs.first().is_some_and(|s| !s.is_empty()) {
                    out.push(segs);
                }
            }
        } else {
            let mut segs = Vec::new();
            let mut r = rest;
            loop {
                let id = ident(r);
                if id.is_empty() {
                    break;
                }
                segs.push(id);
                match r[id.len()..].strip_prefix("::") {
                    Some(next) if !next.starts_with('{') => r = next,
                    _ => break,
                }
            }
            out.push(segs);
        }
    }
    out
}

/// The import edges between a crate's modules (no self-edges).
fn edges(mods: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, code) in mods {
        let own: Vec<&str> = if m.is_empty() {
            Vec::new()
        } else {
            m.split("::").collect()
        };
        let mut to = BTreeSet::new();
        for p in paths_after(code, "crate::") {
            to.insert(resolve(mods, &p));
        }
        if !own.is_empty() {
            let parent = &own[..own.len() - 1];
            for p in paths_after(code, "super::") {
                let full: Vec<&str> = parent.iter().copied().chain(p).collect();
                to.insert(resolve(mods, &full));
            }
        }
        // Child modules named relatively (`admin::serve` in main.rs).
        let prefix = if m.is_empty() {
            String::new()
        } else {
            format!("{m}::")
        };
        for child in mods.keys().filter_map(|k| k.strip_prefix(&prefix)) {
            if child.is_empty() || child.contains("::") {
                continue;
            }
            if !paths_after(code, &format!("{child}::")).is_empty() {
                to.insert(format!("{prefix}{child}"));
            }
        }
        to.remove(m);
        out.insert(m.clone(), to);
    }
    out
}

/// The circles (strongly connected groups of more than one module), Tarjan's way.
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.edges.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut group = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                group.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                s.out.push(group);
            }
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

#[test]
fn no_static_in_the_binary_holds_runtime_state() {
    let src = workspace().join("cli/src");
    let mut found = Vec::new();
    for file in rust_files(&src) {
        for item in stateful_statics(&code(&read(&file))) {
            found.push(format!("{}: {item}", file.display()));
        }
    }
    assert!(
        found.is_empty(),
        "runtime state in statics of the binary (make it a value main creates and passes in):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_binary_is_the_composition_root_only() {
    let src = workspace().join("cli/src");
    let mut sizes: Vec<(usize, PathBuf)> = rust_files(&src)
        .into_iter()
        .map(|f| (read(&f).lines().count(), f))
        .collect();
    let total: usize = sizes.iter().map(|(n, _)| n).sum();
    sizes.sort();
    assert!(
        total <= CLI_MAX_LINES,
        "cli/src holds {total} lines, more than {CLI_MAX_LINES}: move what is no composition \
         into a library crate. Largest: {:?}",
        sizes.iter().rev().take(5).collect::<Vec<_>>()
    );
}

#[test]
fn no_import_circle_between_files() {
    let mut found = Vec::new();
    for krate in ACYCLIC {
        let mods = modules(&workspace().join(krate).join("src"));
        assert!(mods.len() > 1, "{krate}: no modules read");
        for c in circles(&edges(&mods)) {
            found.push(format!("{krate}: {c:?}"));
        }
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// The checkers find what they look for (else the tests above could not fail).
#[test]
fn the_checkers_catch_bad_samples() {
    let bad = "use std::sync::OnceLock;\n\
        /// static DOC: OnceLock<u8> in a comment is no item\n\
        static NODE: OnceLock<Node> = OnceLock::new();\n\
        pub(crate) static COUNT: std::sync::atomic::AtomicU64 = AtomicU64::new(0);\n\
        static mut RAW: u8 = 0;\n\
        thread_local! { static T: u8 = 0; }\n\
        static NAMES: &[&str] = &[\"a\"];\n\
        fn f(x: &'static str) -> &'static str { x }\n\
        const C: &str = \"static S: Mutex<u8>\";\n";
    let found = stateful_statics(&code(bad));
    assert_eq!(
        found,
        [
            "static NODE: OnceLock<Node>",
            "static COUNT: std::sync::atomic::AtomicU64",
            "static mut RAW: u8",
            "thread_local!"
        ]
    );

    let mods: BTreeMap<String, String> = [
        ("", "mod a; mod b; mod c; fn main() { a::run(); }"),
        ("a", "use crate::b::thing;\nuse crate::{c::x, Root};"),
        ("b", "pub fn thing() { super::a::run() }"),
        (
            "c",
            "// crate::a:: in a comment\npub fn x() {}\n#[cfg(test)]\nmod tests { use crate::a; }",
        ),
    ]
    .into_iter()
    .map(|(m, text)| (m.to_string(), without_tests(&code(text)).to_string()))
    .collect();
    let e = edges(&mods);
    assert_eq!(
        e["a"],
        BTreeSet::from(["b".into(), "c".into(), String::new()])
    );
    assert!(e["c"].is_empty(), "{:?}", e["c"]);
    let found = circles(&e);
    assert_eq!(found, [vec![String::new(), "a".into(), "b".into()]]);
}
