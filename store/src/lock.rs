//! The data directory's lock: one broker per data directory. Taken before anything in the
//! directory is read, written or deleted (a second broker must not wipe `transient/` or
//! replay the journal under a running one), held for the process's life, released by the
//! kernel however the process ends (`flock`, so a `kill -9` leaves no stale lock).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The lock file's name in the data directory. It holds the owner's process id (text).
pub const LOCK_FILE: &str = "warren.lock";

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("data directory {dir} is in use by another warren{}", owner.map(|p| format!(" (pid {p})")).unwrap_or_default())]
    InUse { dir: PathBuf, owner: Option<u32> },
    #[error("cannot lock data directory {dir}: {source}")]
    Io {
        dir: PathBuf,
        source: std::io::Error,
    },
}

/// Held while the broker uses the directory; dropping it releases the lock.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

impl DirLock {
    /// Takes the exclusive lock of `dir` (which must exist), without waiting.
    pub fn acquire(dir: &Path) -> Result<DirLock, LockError> {
        let io = |source| LockError::Io {
            dir: dir.to_path_buf(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(dir.join(LOCK_FILE))
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                return Err(LockError::InUse {
                    dir: dir.to_path_buf(),
                    owner: text.trim().parse().ok(),
                });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
        }
        // For the operator who finds the directory in use: who holds it.
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        writeln!(file, "{}", std::process::id()).map_err(io)?;
        Ok(DirLock { _file: file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_a_directory_in_use_fails_and_names_the_owner() {
        let dir = std::env::temp_dir().join(format!("warren-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let held = DirLock::acquire(&dir).expect("first lock");
        match DirLock::acquire(&dir) {
            Err(LockError::InUse { owner, .. }) => assert_eq!(owner, Some(std::process::id())),
            other => panic!("second lock: {other:?}"),
        }
        drop(held);
        DirLock::acquire(&dir).expect("free again once released");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
