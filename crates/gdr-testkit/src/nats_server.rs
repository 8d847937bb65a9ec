//! A real `nats-server` child process with JetStream, for tests.
//!
//! The binary comes from `NATS_SERVER_BIN` or `PATH` (`.ci/run` installs a pinned
//! one). Each server listens on its own loopback port with its own store, so tests
//! run in parallel; `restart` keeps port and store, as a real restart would.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

/// A running nats-server; killed when dropped.
pub struct NatsServer {
    child: Option<Child>,
    port: u16,
    store: Store,
    binary: PathBuf,
}

/// Where a server keeps its JetStream data.
enum Store {
    /// Its own, removed with it.
    Temporary(tempfile::TempDir),
    /// A directory the test names (another component's store).
    At(PathBuf),
}

impl Store {
    fn path(&self) -> &Path {
        match self {
            Store::Temporary(dir) => dir.path(),
            Store::At(path) => path,
        }
    }
}

impl NatsServer {
    /// The nats-server binary: `NATS_SERVER_BIN`, else `nats-server` on `PATH`.
    pub fn binary() -> PathBuf {
        std::env::var_os("NATS_SERVER_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("nats-server"))
    }

    /// Starts a JetStream server on a free loopback port with a fresh store. The port is
    /// picked by binding `:0` and releasing it, which another process may grab in
    /// between; a server that exits at start is retried on a new port.
    pub async fn start() -> std::io::Result<Self> {
        Self::start_in(None).await
    }

    /// Starts a server on the store directory `store` (created if missing), as a server
    /// left over there by a controller that died would be.
    pub async fn start_on(store: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(store)?;
        Self::start_in(Some(store)).await
    }

    async fn start_in(at: Option<&Path>) -> std::io::Result<Self> {
        let mut last = None;
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let store = match at {
                Some(path) => Store::At(path.to_path_buf()),
                None => Store::Temporary(tempfile::tempdir()?),
            };
            let mut server = NatsServer {
                child: None,
                port,
                store,
                binary: Self::binary(),
            };
            match server.spawn().await {
                Ok(()) => return Ok(server),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("nats-server did not start")))
    }

    /// The server's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// Whether the server process has exited (reaping it if so).
    pub fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_none_or(|c| !matches!(c.try_wait(), Ok(None)))
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL) and waits for it to exit.
    pub async fn kill(&mut self) -> std::io::Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill().await?;
        }
        Ok(())
    }

    /// Kills and starts the server again on the same port with the same store. The
    /// port can be busy for a moment after the kill, so the start is retried briefly.
    pub async fn restart(&mut self) -> std::io::Result<()> {
        self.kill().await?;
        let mut last = None;
        for _ in 0..20 {
            match self.spawn().await {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("nats-server did not restart")))
    }

    async fn spawn(&mut self) -> std::io::Result<()> {
        let child = Command::new(&self.binary)
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(self.store.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "cannot start {} (set NATS_SERVER_BIN): {e}",
                        self.binary.display()
                    ),
                )
            })?;
        self.child = Some(child);
        self.wait_ready().await
    }

    /// Ready once a connection receives the server's `INFO` greeting.
    async fn wait_ready(&mut self) -> std::io::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                return Err(std::io::Error::other(format!(
                    "nats-server exited early: {status}"
                )));
            }
            if let Ok(mut stream) = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await {
                let mut greeting = [0u8; 4];
                if stream.read_exact(&mut greeting).await.is_ok() && &greeting == b"INFO" {
                    return Ok(());
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(std::io::Error::other(
                    "nats-server did not become ready within 20s",
                ));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

/// The pids of the live `nats-server` processes (by program name) that have `store` among
/// their arguments: how a test counts the servers on one store, whoever started them.
pub fn servers_on(store: &Path) -> Vec<u32> {
    let wanted = store.as_os_str().as_encoded_bytes();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let mut args = cmdline.split(|b| *b == 0);
            let program = Path::new(std::str::from_utf8(args.next()?).ok()?);
            let is_server = program.file_name()? == "nats-server";
            let running = std::fs::read_to_string(entry.path().join("stat"))
                .ok()
                .and_then(|stat| {
                    let state = stat
                        .rsplit_once(')')?
                        .1
                        .split_whitespace()
                        .next()?
                        .to_owned();
                    Some(state != "Z")
                })
                .unwrap_or(false);
            (is_server && running && args.any(|a| a == wanted)).then_some(pid)
        })
        .collect();
    pids.sort_unstable();
    pids
}

/// A TCP proxy between NATS clients and a nats-server that can drop JetStream's publish
/// acknowledgements (the `{"stream":…}` replies) on their way back and passes everything
/// else: a publish still reaches the server and is stored, the stream stays readable, but
/// the publisher never hears the ack (DESIGN invariant 2's lost acknowledgement).
pub struct AckDropper {
    url: String,
    dropping: tokio::sync::watch::Sender<bool>,
    dropped: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl AckDropper {
    /// A proxy to the server at `server_url` (`nats://host:port`), passing everything.
    pub async fn start(server_url: &str) -> AckDropper {
        let target = server_url
            .strip_prefix("nats://")
            .unwrap_or_else(|| panic!("not a nats:// URL: {server_url}"))
            .to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("cannot bind the NATS proxy: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("the NATS proxy has no address: {e}"));
        let (dropping, watched) = tokio::sync::watch::channel(false);
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = dropped.clone();
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                let (mut client_read, client_write) = inbound.into_split();
                let (server_read, mut server_write) = outbound.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                });
                let (watched, counted) = (watched.clone(), counted.clone());
                tokio::spawn(Self::replies(server_read, client_write, watched, counted));
            }
        });
        AckDropper {
            url: format!("nats://{addr}"),
            dropping,
            dropped,
        }
    }

    /// The URL clients connect to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Drops the publish acks from now on (`true`) or passes them again.
    pub fn drop_acks(&self, drop: bool) {
        self.dropping.send_replace(drop);
    }

    /// The publish acks dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Forwards the server's protocol lines and messages, leaving out the publish acks
    /// while dropping.
    async fn replies(
        server: tokio::net::tcp::OwnedReadHalf,
        mut client: tokio::net::tcp::OwnedWriteHalf,
        dropping: tokio::sync::watch::Receiver<bool>,
        dropped: std::sync::Arc<std::sync::atomic::AtomicU64>,
    ) {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
        let mut server = tokio::io::BufReader::new(server);
        loop {
            let mut line = Vec::new();
            match server.read_until(b'\n', &mut line).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let text = String::from_utf8_lossy(&line).to_string();
            let mut body = Vec::new();
            // `MSG <subject> <sid> [reply] <bytes>` and `HMSG … <header bytes> <total bytes>`:
            // the last field is the size of what follows, then CRLF.
            if text.starts_with("MSG ") || text.starts_with("HMSG ") {
                let Some(size) = text
                    .split_whitespace()
                    .last()
                    .and_then(|s| s.parse::<usize>().ok())
                else {
                    return;
                };
                body.resize(size + 2, 0);
                if server.read_exact(&mut body).await.is_err() {
                    return;
                }
                if *dropping.borrow() && body.starts_with(b"{\"stream\":") {
                    dropped.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    continue;
                }
            }
            line.extend_from_slice(&body);
            if client.write_all(&line).await.is_err() {
                return;
            }
        }
    }
}
