//! Why [`crate::DiskStore::open`] failed, told apart for the operator: a lock (another
//! process has the files: exit code 2 with the "another warren?" hint), damage (exit code 3,
//! one line naming the file and how to recover), or the directory itself.

use crate::definitions::DefinitionsError;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot use data directory {dir}: {source}; check that it exists and is writable")]
    Dir {
        dir: PathBuf,
        source: std::io::Error,
    },
    /// The definitions database cannot be opened or read (damaged, or held by another
    /// process: [`OpenError::is_locked`]).
    #[error("{}", definitions_advice(path, source))]
    Definitions {
        path: PathBuf,
        source: DefinitionsError,
    },
    /// A data file this warren cannot read: damaged past what recovery repairs, or written
    /// in another format.
    #[error("cannot read {path}: {reason}")]
    Unreadable { path: PathBuf, reason: String },
}

impl OpenError {
    /// Another process holds a file of the data directory.
    pub fn is_locked(&self) -> bool {
        matches!(self, OpenError::Definitions { source, .. } if source.is_lock())
    }

    /// A data file is damaged or unreadable (not a problem of flags or permissions).
    pub fn is_damaged(&self) -> bool {
        match self {
            OpenError::Definitions { source, .. } => !source.is_lock(),
            OpenError::Unreadable { .. } => true,
            OpenError::Dir { .. } => false,
        }
    }
}

/// One line: what failed, on which file, and how an operator recovers.
fn definitions_advice(path: &Path, source: &DefinitionsError) -> String {
    if source.is_lock() {
        return format!("cannot open {}: {source}", path.display());
    }
    format!(
        "cannot read {}: {source}. To recover: stop warren, move that file away (or restore \
         it from a backup) and start again; the definitions then start empty: import an \
         export (`warren ctl import-definitions FILE`) or declare the queues again, and each \
         durable queue declared again gets its stored messages back",
        path.display()
    )
}
