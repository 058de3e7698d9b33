//! Starting a real `warren serve` for the CLI's tests.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const BIN: &str = env!("CARGO_BIN_EXE_warren");

/// A started `warren serve` and the ports it logged.
pub struct Served {
    pub child: Child,
    pub amqp: u16,
    /// `None` when started without MQTT.
    pub mqtt: Option<u16>,
    /// Every line it logged so far.
    pub log: Arc<Mutex<Vec<String>>>,
}

/// Starts `warren serve` on `dir` with AMQP (and, if `mqtt`, MQTT) on free loopback
/// ports, plus `args`; waits until it logs them.
pub fn serve(dir: &Path, mqtt: bool, args: &[&str]) -> Served {
    serve_logging(dir, mqtt, args, "info")
}

/// `serve`, logging at `level` (`RUST_LOG`).
pub fn serve_logging(dir: &Path, mqtt: bool, args: &[&str], level: &str) -> Served {
    let mqtt_addr = if mqtt { "127.0.0.1:0" } else { "none" };
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--amqp",
            "127.0.0.1:0",
            "--mqtt",
            mqtt_addr,
            "--data-dir",
        ])
        .arg(dir)
        .args(args)
        .env("RUST_LOG", level)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start warren serve");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    let log = Arc::new(Mutex::new(Vec::new()));
    let kept = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(mut kept) = kept.lock() {
                kept.push(line.clone());
            }
            if let Some(rest) = line.split("listening on 127.0.0.1:").nth(1) {
                let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
                let _ = tx.send((rest.contains("(MQTT"), port.parse::<u16>().ok()));
            }
        }
    });
    let (mut amqp, mut mqtt_port) = (None, None);
    while amqp.is_none() || (mqtt && mqtt_port.is_none()) {
        let (is_mqtt, p) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("warren serve logs its ports within 20 s");
        *(if is_mqtt { &mut mqtt_port } else { &mut amqp }) = p;
    }
    Served {
        child,
        amqp: amqp.expect("AMQP port"),
        mqtt: mqtt_port,
        log,
    }
}
