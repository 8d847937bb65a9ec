//! A real `nats-server` child process with JetStream, for tests.
//!
//! The binary comes from `NATS_SERVER_BIN` or `PATH` (`.ci/run` installs a pinned
//! one). Each server listens on its own loopback port with its own store, so tests
//! run in parallel; `restart` keeps port and store, as a real restart would.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

/// A running nats-server; killed when dropped.
pub struct NatsServer {
    child: Option<Child>,
    port: u16,
    store: tempfile::TempDir,
    binary: PathBuf,
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
        let mut last = None;
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let store = tempfile::tempdir()?;
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
