//! The embedded single-host NATS server: a supervised `nats-server` child with
//! JetStream, listening on loopback only, its store under the state directory.
//! Production deployments point `nats_url` at a cluster instead.
//!
//! Loopback is not a trust boundary (every local process can connect), so the server
//! requires credentials (DESIGN invariant 21): a producer and a worker user with random
//! passwords, generated at each start into files only the controller's user can read
//! (the store directory is 0700, the files 0600).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};
use tokio::sync::Notify;

/// The users of the embedded server.
const PRODUCER_USER: &str = "gdr-producer";
const WORKER_USER: &str = "gdr-worker";
/// Largest message the embedded server takes (its default is 1 MiB): a task Gitea hands
/// out can be as large as `gitea::FETCH_TASK_MESSAGE_LIMIT` (32 MiB), and its envelope is
/// base64 of it, a third larger. 64 MB is nats-server's own upper bound.
const MAX_PAYLOAD: &str = "64MB";

/// A supervised nats-server; stopped when dropped.
pub struct EmbeddedNats {
    port: u16,
    store: PathBuf,
    stop: Arc<Notify>,
    supervisor: tokio::task::JoinHandle<()>,
}

/// The credentials and configuration of an embedded server, written under `store`.
fn write_auth(store: &Path) -> Result<PathBuf, String> {
    use std::fmt::Write as _;
    use std::os::unix::fs::OpenOptionsExt;
    let write = |name: &str, content: &str| -> Result<PathBuf, String> {
        let path = store.join(name);
        // Replaced, not rewritten in place: a file an older release left 0644 must not
        // keep its mode.
        let _ = std::fs::remove_file(&path);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        std::io::Write::write_all(&mut file, content.as_bytes())
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        Ok(path)
    };
    let password = || -> String {
        let bytes: [u8; 24] = rand::random();
        bytes.iter().fold(String::new(), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
    };
    let (producer, worker) = (password(), password());
    write(&format!("{PRODUCER_USER}.password"), &producer)?;
    write(&format!("{WORKER_USER}.password"), &worker)?;
    write(
        "auth.conf",
        &format!(
            "max_payload: {MAX_PAYLOAD}\n\
             authorization {{\n  users = [\n    {{ user: \"{PRODUCER_USER}\", password: \"{producer}\" }}\n    {{ user: \"{WORKER_USER}\", password: \"{worker}\" }}\n  ]\n}}\n"
        ),
    )
}

impl EmbeddedNats {
    /// Starts the server (store in `store`) and waits until it accepts clients.
    pub async fn start(binary: &Path, store: &Path) -> Result<Self, String> {
        crate::runtime::private_dir(store).map_err(|e| format!("the NATS store: {e}"))?;
        let config = write_auth(store)?;
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
            let mut child = spawn(&binary, &store, &config, port)?;
            match wait_ready(&mut child, port).await {
                Ok(()) => break (child, port),
                Err(e) if attempt >= 4 => return Err(e),
                Err(_) => attempt += 1,
            }
        };
        tracing::info!(port, store = %store.display(), "embedded nats-server started");
        let stop = Arc::new(Notify::new());
        let supervisor = tokio::spawn(supervise(
            child,
            binary,
            store.clone(),
            config,
            port,
            stop.clone(),
        ));
        Ok(EmbeddedNats {
            port,
            store,
            stop,
            supervisor,
        })
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// How the scheduler's connection authenticates.
    pub fn producer_auth(&self) -> crate::settings::NatsAuth {
        self.auth(PRODUCER_USER)
    }

    /// How the workers' connection authenticates.
    pub fn worker_auth(&self) -> crate::settings::NatsAuth {
        self.auth(WORKER_USER)
    }

    fn auth(&self, user: &str) -> crate::settings::NatsAuth {
        crate::settings::NatsAuth::Password {
            user: user.to_owned(),
            file: self.store.join(format!("{user}.password")),
            key: "state_dir",
        }
    }
}

impl Drop for EmbeddedNats {
    fn drop(&mut self) {
        self.stop.notify_one();
        self.supervisor.abort();
    }
}

fn spawn(binary: &PathBuf, store: &Path, config: &Path, port: u16) -> Result<Child, String> {
    Command::new(binary)
        .arg("-c")
        .arg(config)
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
    config: PathBuf,
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
                match spawn(&binary, &store, &config, port) {
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
