//! File bytes to a TCP socket without copying them through user space: `sendfile(2)` on
//! Linux, driven by tokio's readiness so a full socket buffer parks the task instead of a
//! thread. Protocol shells use it for large payloads that are already on disk in the form
//! the wire wants (the stream protocol's chunks); where it is not available they copy.

use std::fs::File;
use std::io;
use tokio::net::TcpStream;

/// Whether [`send_file`] can work on this platform (else it returns `Unsupported`).
pub const SENDFILE: bool = cfg!(target_os = "linux");

/// Writes `len` bytes of `file` from `offset` to `socket`, all of them (or an error). The
/// caller has written everything that precedes them to the same socket (tokio's
/// `TcpStream` buffers nothing, so bytes written before are on their way first).
#[cfg(target_os = "linux")]
pub async fn send_file(socket: &TcpStream, file: &File, offset: u64, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut off = i64::try_from(offset).map_err(|_| io::Error::other("file offset too large"))?;
    let end = off
        .checked_add(i64::try_from(len).map_err(|_| io::Error::other("length too large"))?)
        .ok_or_else(|| io::Error::other("file range past the end of offsets"))?;
    while off < end {
        socket.writable().await?;
        // At most 1 GiB per call (Linux caps a call near 2 GiB anyway).
        let count = (end - off).min(1 << 30) as usize;
        let sent = socket.try_io(tokio::io::Interest::WRITABLE, || {
            // SAFETY: both descriptors are open for the call (borrowed from live owners),
            // and `off` is a valid i64 the kernel reads and advances.
            let n =
                unsafe { libc::sendfile(socket.as_raw_fd(), file.as_raw_fd(), &mut off, count) };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        match sent {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "file shorter than the range to send",
                ));
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
pub async fn send_file(
    _socket: &TcpStream,
    _file: &File,
    _offset: u64,
    _len: u64,
) -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "sendfile is used on Linux only",
    ))
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::io::Write;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn a_file_range_arrives_whole_through_a_full_socket_buffer() {
        let path = std::env::temp_dir().join(format!("warren-sendfile-{}", std::process::id()));
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&data)
            .unwrap();
        let file = File::open(&path).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let reader = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).await.unwrap();
            got
        });
        let socket = TcpStream::connect(addr).await.unwrap();
        // 2.9 MB from offset 100: more than a socket buffer holds, so the send parks on
        // readiness at least once.
        send_file(&socket, &file, 100, 2_900_000).await.unwrap();
        drop(socket);
        let got = reader.await.unwrap();
        assert_eq!(got.len(), 2_900_000);
        assert!(got == data[100..2_900_100]);
        // A range past the end of the file is an error, not a hang.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _accept = tokio::spawn(async move { listener.accept().await });
        let socket = TcpStream::connect(addr).await.unwrap();
        let e = send_file(&socket, &file, 2_999_000, 5_000)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        std::fs::remove_file(&path).unwrap();
    }
}
