//! The host's view of the machine for the core's resource alarms: the process's resident
//! memory and the free space on the data disk, measured on a timer and reported to every
//! shard (`Broker::report_resources`). The core decides; this only measures.

use crate::{BrokerHandle, Control};
use std::path::PathBuf;
use std::time::Duration;
use warren_core::Resources;

/// What to measure, and how often.
#[derive(Clone, Debug)]
pub struct ResourceWatch {
    /// Time between measurements (RabbitMQ polls memory every 2.5 s and disk every 1-10 s).
    pub interval: Duration,
    /// Measure the process's RSS (`/proc/self/statm`; Linux only).
    pub memory: bool,
    /// Measure the free space of the file system holding this directory (`statvfs`).
    pub disk: Option<PathBuf>,
    /// Above this RSS, give freed heap back to the OS before each measurement
    /// (`malloc_trim`, glibc), so memory the queues released counts as released and the
    /// alarm can clear. Set it below the alarm's clearing point.
    pub trim_above: u64,
}

/// Resident memory of this process, in bytes (`None` where `/proc` is unavailable).
pub fn process_rss() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages.saturating_mul(page_size()))
}

#[cfg(unix)]
fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions; it returns -1 for an unknown name.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

#[cfg(not(unix))]
fn page_size() -> u64 {
    4096
}

/// Bytes available to this (unprivileged) process on the file system holding `dir`, as
/// `df` reports them.
#[cfg(unix)]
pub fn disk_free(dir: &std::path::Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `path` is a valid NUL-terminated string and `stat` a plain struct that
    // statvfs fills; both live across the call.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(path.as_ptr(), &mut stat) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
    Ok((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

#[cfg(not(unix))]
pub fn disk_free(_dir: &std::path::Path) -> std::io::Result<u64> {
    Err(std::io::Error::other(
        "free disk space is measured on Unix only",
    ))
}

/// Returns freed heap to the OS (glibc keeps freed memory in its arenas, where it still
/// counts in RSS).
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

impl BrokerHandle {
    /// Measures what `watch` asks for every `watch.interval` and reports it to every
    /// shard, until the broker stops. Measures once at once, so publishers are blocked
    /// from the start when the disk is already short.
    pub fn watch_resources(&self, watch: ResourceWatch) {
        let handle = self.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(watch.interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last_rss = 0;
            let mut disk_error_logged = false;
            loop {
                ticker.tick().await;
                let memory = if watch.memory {
                    if last_rss > watch.trim_above {
                        trim_heap();
                    }
                    process_rss()
                } else {
                    None
                };
                last_rss = memory.unwrap_or(0);
                let disk_free = match &watch.disk {
                    Some(dir) => match disk_free(dir) {
                        Ok(free) => {
                            disk_error_logged = false;
                            Some(free)
                        }
                        Err(e) => {
                            if !disk_error_logged {
                                tracing::warn!(dir = %dir.display(), error = %e, "cannot measure free disk space; the disk alarm is off until it can");
                                disk_error_logged = true;
                            }
                            None
                        }
                    },
                    None => None,
                };
                let resources = Resources { memory, disk_free };
                if !handle.report_resources(resources) {
                    return;
                }
            }
        });
    }

    /// Reports measurements to every shard (`Broker::report_resources`; `watch_resources`
    /// calls it on its timer); false once the broker is gone.
    pub fn report_resources(&self, resources: Resources) -> bool {
        self.shared
            .shards
            .iter()
            .all(|shard| shard.control.send(Control::Resources(resources)).is_ok())
    }
}
