//! A stand-in for the Kubernetes Service in front of leader-elected controller replicas:
//! every connection goes to the facade of a replica whose `/readyz` answers 200 (only the
//! leader is ready); with no ready replica the connection is closed at once, as a Service
//! without ready endpoints refuses it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;

/// How long one readiness probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// A TCP forwarder to the ready replica's facade.
pub struct ReadyService {
    addr: SocketAddr,
    /// `(facade, health)` of every replica.
    targets: Arc<Mutex<Vec<(SocketAddr, SocketAddr)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ReadyService {
    /// Listens on a loopback port of its own.
    pub async fn start() -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let targets = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn(forward(listener, targets.clone()));
        Ok(ReadyService {
            addr,
            targets,
            task,
        })
    }

    /// The address executors dial (the facade URL's host and port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Adds a replica by its facade and health addresses.
    pub async fn add(&self, facade: SocketAddr, health: SocketAddr) {
        self.targets.lock().await.push((facade, health));
    }
}

impl Drop for ReadyService {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(
    listener: tokio::net::TcpListener,
    targets: Arc<Mutex<Vec<(SocketAddr, SocketAddr)>>>,
) {
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            return;
        };
        let targets = targets.clone();
        tokio::spawn(async move {
            let candidates = targets.lock().await.clone();
            for (facade, health) in candidates {
                if is_ready(health).await {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(facade).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                    return;
                }
            }
        });
    }
}

/// Whether the controller whose health server listens on `health` answers `/readyz` with
/// 200.
pub async fn is_ready(health: SocketAddr) -> bool {
    let probe = async {
        let mut stream = tokio::net::TcpStream::connect(health).await.ok()?;
        stream
            .write_all(b"GET /readyz HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .await
            .ok()?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await.ok()?;
        Some(head.starts_with(b"HTTP/1.") && &head[9..12] == b"200")
    };
    matches!(
        tokio::time::timeout(PROBE_TIMEOUT, probe).await,
        Ok(Some(true))
    )
}
