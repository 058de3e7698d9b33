//! What the runtime's integration tests share.

/// `f` within 10 s; the panic names `what` and the caller's line (a plain fn, not `async`, so
/// that `#[track_caller]` holds). For sends into a shard's bounded mailbox, which wait while
/// the shard task does not take them.
#[track_caller]
pub fn bounded_as<F: std::future::Future>(
    what: &'static str,
    f: F,
) -> impl std::future::Future<Output = F::Output> {
    let at = std::panic::Location::caller();
    async move {
        tokio::time::timeout(std::time::Duration::from_secs(10), f)
            .await
            .unwrap_or_else(|_| panic!("no {what} within 10 s (awaited at {at})"))
    }
}
