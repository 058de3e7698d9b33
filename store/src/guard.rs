//! Calls into redb on a file that may be damaged: redb answers most damage with an error,
//! but some pages it cannot make sense of make it panic (seen on random byte flips in
//! `definitions.redb`). A panic there must end in one clear error naming the file, not a
//! backtrace and exit 101 (which a supervisor restarts in a loop), so such calls run under
//! `catch_unwind`, with the panic message captured instead of printed.

use std::panic::{self, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

/// Runs `f`; a panic inside it (on this thread) becomes `Err(its message)`. Panics on other
/// threads meanwhile go to the hook that was installed.
pub(crate) fn catch_quietly<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    let me = std::thread::current().id();
    let caught = Arc::new(Mutex::new(None::<String>));
    let previous = Arc::new(panic::take_hook());
    {
        let previous = Arc::clone(&previous);
        let caught = Arc::clone(&caught);
        panic::set_hook(Box::new(move |info| {
            if std::thread::current().id() == me {
                let message = info
                    .payload()
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_string())
                    .or_else(|| info.payload().downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                let at = info
                    .location()
                    .map(|l| format!(" at {}:{}", l.file(), l.line()))
                    .unwrap_or_default();
                if let Ok(mut c) = caught.lock() {
                    *c = Some(format!("{message}{at}"));
                }
            } else {
                previous(info);
            }
        }));
    }
    let result = panic::catch_unwind(AssertUnwindSafe(f));
    // Our hook holds the other reference to `previous`: dropping it gives `previous` back.
    drop(panic::take_hook());
    if let Ok(previous) = Arc::try_unwrap(previous) {
        panic::set_hook(previous);
    }
    result.map_err(|_| {
        caught
            .lock()
            .ok()
            .and_then(|mut c| c.take())
            .unwrap_or_else(|| "a panic".into())
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_panic_becomes_its_message() {
        let r: Result<(), String> = super::catch_quietly(|| panic!("page 7 is garbage"));
        let e = r.expect_err("caught");
        assert!(e.starts_with("page 7 is garbage at "), "{e}");
        assert_eq!(super::catch_quietly(|| 5), Ok(5));
    }
}
