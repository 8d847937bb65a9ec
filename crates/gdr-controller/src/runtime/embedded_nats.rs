//! The embedded single-host NATS server: a supervised `nats-server` child with
//! JetStream, listening on loopback only, its store under the state directory.
//! Production deployments point `nats_url` at a cluster instead.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};
use tokio::sync::Notify;

/// A supervised nats-server; stopped when dropped.
pub struct EmbeddedNats {
    port: u16,
    stop: Arc<Notify>,
    supervisor: tokio::task::JoinHandle<()>,
}

impl EmbeddedNats {
    /// Starts the server (store in `store`) and waits until it accepts clients.
    pub async fn start(binary: &Path, store: &Path) -> Result<Self, String> {
        std::fs::create_dir_all(store)
            .map_err(|e| format!("creating the NATS store {}: {e}", store.display()))?;
        let binary = binary.to_path_buf();
        let store = store.to_path_buf();
        // The port comes from binding :0 and releasing it; another process can take it
        // in between, so a server that exits at start is retried on a new port.
        let mut attempt = 0;
        let (child, port) = loop {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| format!("choosing a loopback port for NATS: {e}"))?
                .port();
            let mut child = spawn(&binary, &store, port)?;
            match wait_ready(&mut child, port).await {
                Ok(()) => break (child, port),
                Err(e) if attempt >= 4 => return Err(e),
                Err(_) => attempt += 1,
            }
        };
        tracing::info!(port, store = %store.display(), "embedded nats-server started");
        let stop = Arc::new(Notify::new());
        let supervisor = tokio::spawn(supervise(child, binary, store, port, stop.clone()));
        Ok(EmbeddedNats {
            port,
            stop,
            supervisor,
        })
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for EmbeddedNats {
    fn drop(&mut self) {
        self.stop.notify_one();
        self.supervisor.abort();
    }
}

fn spawn(binary: &PathBuf, store: &Path, port: u16) -> Result<Child, String> {
    Command::new(binary)
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
        .arg(store)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("starting {} (nats_server_binary): {e}", binary.display()))
}

async fn wait_ready(child: &mut Child, port: u16) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("nats-server exited at start: {status}"));
        }
        if let Ok(mut stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            let mut greeting = [0u8; 4];
            if stream.read_exact(&mut greeting).await.is_ok() && &greeting == b"INFO" {
                return Ok(());
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err("nats-server did not accept clients within 30s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Restarts the server when it exits (clients reconnect by themselves).
async fn supervise(
    mut child: Child,
    binary: PathBuf,
    store: PathBuf,
    port: u16,
    stop: Arc<Notify>,
) {
    loop {
        tokio::select! {
            _ = stop.notified() => {
                let _ = child.kill().await;
                return;
            }
            status = child.wait() => {
                tracing::error!(?status, "embedded nats-server exited; restarting");
                tokio::time::sleep(Duration::from_secs(1)).await;
                match spawn(&binary, &store, port) {
                    Ok(mut next) => {
                        if let Err(e) = wait_ready(&mut next, port).await {
                            tracing::error!(error = %e, "embedded nats-server restart failed");
                        }
                        child = next;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "embedded nats-server restart failed; retrying");
                        tokio::time::sleep(Duration::from_secs(5)).await;
                    }
                }
            }
        }
    }
}
