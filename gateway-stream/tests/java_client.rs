//! RabbitMQ's Java stream client (`com.rabbitmq:stream-client` 0.20.0, Maven Central) against
//! `warren_stream::serve`: `tests/java/StreamCheck.java` publishes with confirms, re-sends
//! publishing ids, consumes from `first` (Deliver v2) and stores an offset. Ignored by
//! default: it needs Java 17 and the client's jars in `target/stream-java/lib`, which
//! scripts/test.sh fetches (`mvn -f gateway-stream/tests/java/pom.xml
//! dependency:copy-dependencies`) before running it with `--ignored`.

use std::path::PathBuf;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;
use warren_stream::MemoryBackend;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Java 17 and target/stream-java/lib (scripts/test.sh)"]
async fn java_stream_client_publishes_consumes_dedups_and_tracks_offsets() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let lib = root.join("../target/stream-java/lib");
    assert!(
        lib.is_dir(),
        "{} missing: fetch the jars first",
        lib.display()
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, rx) = watch::channel(false);
    let server = tokio::spawn(warren_stream::serve(
        listener,
        Arc::new(MemoryBackend::new()),
        rx,
    ));
    let count = std::env::var("STREAM_JAVA_COUNT").unwrap_or_else(|_| "100000".into());
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(300),
        tokio::process::Command::new("java")
            .arg("-cp")
            .arg(format!("{}/*", lib.display()))
            .arg(root.join("tests/java/StreamCheck.java"))
            .args(["127.0.0.1", &port.to_string(), &count])
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("java finished within 300 s")
    .expect("java runs");
    println!("{}", String::from_utf8_lossy(&out.stdout));
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "StreamCheck failed: {:?}", out.status);
    let _ = stop.send(true);
    let _ = server.await;
}
