//! Before replay rewrites the segment files: which of their bytes disagree with what the
//! journal says was last written there. After a clean stop or a crash of the process the
//! files hold exactly those bytes (every write reaches the file before its journal record
//! reaches the journal), so a difference is damage on disk, or writes a machine lost in a
//! power cut. Replay repairs them either way; this makes the repair visible instead of
//! silent (one `warn` line per file).
//!
//! Only a write's final bytes are compared: for each write, the parts no later write of the
//! same file overwrites, in a file no later record deletes, and not written after an
//! earlier deletion of it in the journal (that file's older incarnation is on disk).

use crate::journal::{Op, decode};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// A write to compare, in journal order.
struct Write {
    path: u32,
    offset: u64,
    len: u64,
    /// Which generation file, and where in it the written bytes are.
    generation: usize,
    data_at: u64,
    /// False once the journal deleted this file (or its directory) before the write.
    compare: bool,
}

enum Step {
    Write(Write),
    DeleteFile(u32),
    DeleteDir(PathBuf),
}

/// What one file's comparison found.
#[derive(Default)]
struct Differs {
    bytes: u64,
    places: u64,
    first: Option<u64>,
}

/// Logs, per segment file, the bytes the journal's last writes disagree with.
pub(crate) fn report(root: &Path, plans: &[(File, Vec<(u64, u64)>)]) -> io::Result<()> {
    let mut names: Vec<PathBuf> = Vec::new();
    let mut ids: HashMap<PathBuf, u32> = HashMap::new();
    let mut steps = Vec::new();
    let mut deleted: HashSet<PathBuf> = HashSet::new();
    let mut payload = Vec::new();
    for (generation, (file, records)) in plans.iter().enumerate() {
        for &(at, len) in records {
            payload.resize((len - 8) as usize, 0);
            file.read_exact_at(&mut payload, at + 8)?;
            let Some(op) = decode(&payload) else {
                continue;
            };
            let mut id = |p: &Path| -> u32 {
                *ids.entry(p.to_path_buf()).or_insert_with(|| {
                    names.push(p.to_path_buf());
                    (names.len() - 1) as u32
                })
            };
            steps.push(match op {
                Op::Write(path, offset, bytes) => {
                    let parent = path.parent().map(Path::to_path_buf).unwrap_or_default();
                    let compare = !deleted.contains(path) && !deleted.contains(&parent);
                    Step::Write(Write {
                        path: id(path),
                        offset,
                        len: bytes.len() as u64,
                        generation,
                        // Framing 8, kind 1, path length 2, the path, the offset 8.
                        data_at: at + 8 + 3 + path.as_os_str().len() as u64 + 8,
                        compare,
                    })
                }
                Op::DeleteFile(path) => {
                    deleted.insert(path.to_path_buf());
                    Step::DeleteFile(id(path))
                }
                Op::DeleteDir(path) => {
                    deleted.insert(path.to_path_buf());
                    Step::DeleteDir(path.to_path_buf())
                }
            });
        }
    }
    // Backwards: what later steps overwrite or delete is not final.
    let mut covered: HashMap<u32, BTreeMap<u64, u64>> = HashMap::new();
    let mut gone_files: HashSet<u32> = HashSet::new();
    let mut gone_dirs: HashSet<PathBuf> = HashSet::new();
    let mut found: BTreeMap<u32, Differs> = BTreeMap::new();
    let mut open: HashMap<u32, Option<File>> = HashMap::new();
    for step in steps.iter().rev() {
        let w = match step {
            Step::Write(w) => w,
            Step::DeleteFile(id) => {
                gone_files.insert(*id);
                continue;
            }
            Step::DeleteDir(dir) => {
                gone_dirs.insert(dir.clone());
                continue;
            }
        };
        let name = &names[w.path as usize];
        let gone =
            gone_files.contains(&w.path) || name.parent().is_some_and(|p| gone_dirs.contains(p));
        let spans = covered.entry(w.path).or_default();
        let fresh = uncovered(spans, w.offset, w.offset + w.len);
        cover(spans, w.offset, w.offset + w.len);
        if gone || !w.compare || fresh.is_empty() {
            continue;
        }
        let disk = open
            .entry(w.path)
            .or_insert_with(|| File::open(root.join(name)).ok());
        for (from, to) in fresh {
            let mut want = vec![0u8; (to - from) as usize];
            plans[w.generation]
                .0
                .read_exact_at(&mut want, w.data_at + (from - w.offset))?;
            let mut have = vec![0u8; want.len()];
            let read = match disk {
                Some(f) => read_up_to(f, &mut have, from)?,
                None => 0,
            };
            let mut differing = (want.len() - read) as u64;
            let mut first = (read < want.len()).then_some(from + read as u64);
            for (i, (a, b)) in want[..read].iter().zip(&have[..read]).enumerate() {
                if a != b {
                    differing += 1;
                    first = Some(first.map_or(from + i as u64, |f| f.min(from + i as u64)));
                }
            }
            if differing > 0 {
                let d = found.entry(w.path).or_default();
                d.bytes += differing;
                d.places += 1;
                d.first = match (d.first, first) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
        }
    }
    for (id, d) in found {
        tracing::warn!(
            file = %root.join(&names[id as usize]).display(),
            bytes = d.bytes,
            places = d.places,
            first_offset = d.first.unwrap_or(0),
            "segment file differs from what the journal says was written there: damage on \
             disk, or writes lost in a power cut; repaired from the journal"
        );
    }
    Ok(())
}

/// Reads into `buf` at `at`; returns how many bytes the file had there.
fn read_up_to(f: &File, buf: &mut [u8], at: u64) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read_at(&mut buf[n..], at + n as u64)? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// The parts of `from..to` that `spans` (disjoint, start -> end) does not cover.
fn uncovered(spans: &BTreeMap<u64, u64>, from: u64, to: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = from;
    // The span starting before `from` may reach into it.
    let before = spans.range(..from).next_back().map(|(s, e)| (*s, *e));
    let starts = before
        .into_iter()
        .chain(spans.range(from..to).map(|(s, e)| (*s, *e)));
    for (s, e) in starts {
        if e <= at {
            continue;
        }
        if s > at {
            out.push((at, s.min(to)));
        }
        at = at.max(e);
        if at >= to {
            break;
        }
    }
    if at < to {
        out.push((at, to));
    }
    out
}

/// Adds `from..to` to `spans`, merging what it touches.
fn cover(spans: &mut BTreeMap<u64, u64>, mut from: u64, mut to: u64) {
    if let Some((&s, &e)) = spans.range(..=from).next_back()
        && e >= from
    {
        from = s;
        to = to.max(e);
    }
    let inside: Vec<(u64, u64)> = spans.range(from..=to).map(|(s, e)| (*s, *e)).collect();
    for (s, e) in inside {
        spans.remove(&s);
        to = to.max(e);
    }
    spans.insert(from, to);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_subtract_and_merge() {
        let mut spans = BTreeMap::new();
        cover(&mut spans, 10, 20);
        cover(&mut spans, 30, 40);
        assert_eq!(uncovered(&spans, 0, 50), vec![(0, 10), (20, 30), (40, 50)]);
        assert_eq!(uncovered(&spans, 15, 35), vec![(20, 30)]);
        assert_eq!(uncovered(&spans, 12, 18), vec![]);
        cover(&mut spans, 20, 30);
        assert_eq!(spans.into_iter().collect::<Vec<_>>(), vec![(10, 40)]);
    }
}
