//! A raw stream-protocol client for the CLI's stream tests (included with `#[path]` by the
//! test files that use it).
#![allow(dead_code)]

use std::time::Duration;

/// A raw stream-protocol connection (frames of `warren_stream::codec`), for the answers the
/// Rust client hides: PublishError frames with their codes, Close codes.
pub struct Raw {
    pub s: tokio::net::TcpStream,
    buf: bytes::BytesMut,
    /// What the server's Open response carried (advertised host and port).
    pub open_properties: Vec<(String, String)>,
}

impl Raw {
    pub async fn open(port: u16) -> Raw {
        Raw::open_as(port, None).await
    }

    /// Opens a connection to vhost `/` as guest, with `connection_name` when given.
    pub async fn open_as(port: u16, name: Option<&str>) -> Raw {
        use bytes::Bytes;
        use warren_stream::codec::Frame;
        let mut c = Raw {
            s: tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap(),
            buf: bytes::BytesMut::new(),
            open_properties: Vec::new(),
        };
        c.send(&Frame::PeerProperties {
            corr: 1,
            properties: name
                .map(|n| ("connection_name".to_string(), n.to_string()))
                .into_iter()
                .collect(),
        })
        .await;
        assert!(matches!(
            c.recv().await,
            Some(Frame::PeerPropertiesResponse { code: 1, .. })
        ));
        c.send(&Frame::SaslHandshake { corr: 2 }).await;
        c.recv().await;
        c.send(&Frame::SaslAuthenticate {
            corr: 3,
            mechanism: "PLAIN".into(),
            data: Bytes::from_static(b"\0guest\0guest"),
        })
        .await;
        assert!(matches!(
            c.recv().await,
            Some(Frame::SaslAuthenticateResponse { code: 1, .. })
        ));
        let Some(Frame::Tune { frame_max, .. }) = c.recv().await else {
            panic!("no tune")
        };
        c.send(&Frame::TuneResponse {
            frame_max,
            heartbeat: 0,
        })
        .await;
        c.send(&Frame::Open {
            corr: 4,
            vhost: "/".into(),
        })
        .await;
        match c.recv().await {
            Some(Frame::OpenResponse {
                code: 1,
                properties,
                ..
            }) => c.open_properties = properties,
            other => panic!("open, got {other:?}"),
        }
        c
    }

    pub async fn send(&mut self, f: &warren_stream::codec::Frame) {
        use tokio::io::AsyncWriteExt;
        self.s
            .write_all(&warren_stream::codec::to_bytes(f))
            .await
            .unwrap();
    }

    /// The next frame within `wait`: `None` when none came (or at EOF).
    pub async fn recv_within(&mut self, wait: Duration) -> Option<warren_stream::codec::Frame> {
        use tokio::io::AsyncReadExt;
        tokio::time::timeout(wait, async {
            loop {
                if let Some(body) = warren_stream::frame::split_frame(&mut self.buf, 0).unwrap() {
                    return Some(warren_stream::codec::decode(body).expect("server frames decode"));
                }
                if self.s.read_buf(&mut self.buf).await.unwrap_or(0) == 0 {
                    return None;
                }
            }
        })
        .await
        .ok()
        .flatten()
    }

    /// The next frame (None at EOF), within 10 s.
    pub async fn recv(&mut self) -> Option<warren_stream::codec::Frame> {
        use tokio::io::AsyncReadExt;
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Some(body) = warren_stream::frame::split_frame(&mut self.buf, 0).unwrap() {
                    return Some(warren_stream::codec::decode(body).expect("server frames decode"));
                }
                if self.s.read_buf(&mut self.buf).await.unwrap_or(0) == 0 {
                    return None;
                }
            }
        })
        .await
        .expect("a frame within 10 s")
    }

    pub async fn request(&mut self, f: warren_stream::codec::Frame) -> u16 {
        use warren_stream::codec::Frame;
        self.send(&f).await;
        match self.recv().await {
            Some(Frame::Response { code, .. }) => code,
            other => panic!("a response to {f:?}, got {other:?}"),
        }
    }
}
