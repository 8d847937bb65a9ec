//! The real OpenSandbox server (`opensandbox-server==1.1.1` from PyPI) as a test peer.
//!
//! [`OpenSandboxServer::shared`] starts one server per test binary on first use (start-up
//! takes 8–20 s on a 2-core machine, mostly Python imports) and keeps it for the binary's lifetime; tests isolate themselves
//! by pool name and metadata (prefix) rather than by server. The server runs in Kubernetes
//! mode on an in-memory cluster (`opensandbox/fake_k8s.py`), whose pools, slow starts,
//! failures and local entrypoint processes a test drives through [`Control`].
//!
//! The interpreter is `OPENSANDBOX_PYTHON`, else the virtualenv `install.sh` creates by
//! default (`$HOME/.cache/gdr-opensandbox-venv/bin/python`).
//!
//! Timeouts of the shared server, named here because tests depend on them: a blocking
//! create gives up after [`CREATE_TIMEOUT`] (504, the sandbox deleted; the production
//! default is 60 s) and a full pool answers 429 after [`POOL_ACQUISITION_TIMEOUT`] (30 s in
//! production) with `Retry-After` of the same number of seconds.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use tokio::sync::OnceCell;

/// The shared server's blocking-create timeout (`sandbox_create_timeout_seconds`).
pub const CREATE_TIMEOUT: Duration = Duration::from_secs(10);
/// The shared server's pool acquisition timeout (`pool_acquisition_timeout_seconds`).
pub const POOL_ACQUISITION_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait for the server to announce its ports (measured 8–9 s on a lightly loaded
/// 2-core machine, 17–19 s while other builds ran).
const START_DEADLINE: Duration = Duration::from_secs(120);

/// The harness scripts, beside this crate's sources.
fn harness_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("opensandbox")
}

/// The Python interpreter of the OpenSandbox virtualenv.
pub fn python() -> PathBuf {
    if let Some(python) = std::env::var_os("OPENSANDBOX_PYTHON") {
        return PathBuf::from(python);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/gdr-opensandbox-venv/bin/python")
}

/// A running server. Killed when the test binary exits: the harness exits when its stdin
/// closes, and this process holds the other end.
pub struct OpenSandboxServer {
    /// Base URL of the Lifecycle API, `http://127.0.0.1:<port>/v1`.
    pub url: String,
    /// The API key the server requires.
    pub api_key: String,
    /// The cluster side of the server.
    pub control: Control,
    _child: Child,
    _stdin: ChildStdin,
    workdir: tempfile::TempDir,
}

static SHARED: OnceCell<OpenSandboxServer> = OnceCell::const_new();

#[derive(Deserialize)]
struct Announce {
    api_port: u16,
    control_port: u16,
}

impl OpenSandboxServer {
    /// The server shared by every test of this binary, started on first use.
    pub async fn shared() -> std::io::Result<&'static OpenSandboxServer> {
        SHARED
            .get_or_try_init(|| async {
                tokio::task::spawn_blocking(|| {
                    Self::start(CREATE_TIMEOUT, POOL_ACQUISITION_TIMEOUT)
                })
                .await
                .map_err(std::io::Error::other)?
            })
            .await
    }

    /// Starts a server of its own with these timeouts (blocking until it serves).
    pub fn start(create_timeout: Duration, pool_timeout: Duration) -> std::io::Result<Self> {
        let workdir = tempfile::tempdir()?;
        let api_key = format!("test-key-{:032x}", rand::random::<u128>());
        let key_file = workdir.path().join("api-key");
        std::fs::write(&key_file, &api_key)?;
        let log_path = workdir.path().join("server.log");
        let python = python();
        let mut child = Command::new(&python)
            .arg(harness_dir().join("harness.py"))
            .arg("--workdir")
            .arg(workdir.path())
            .arg("--api-key-file")
            .arg(&key_file)
            .arg("--create-timeout")
            .arg(create_timeout.as_secs().to_string())
            .arg("--pool-acquisition-timeout")
            .arg(pool_timeout.as_secs().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log_path)?)
            .spawn()
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "cannot run {} (install with crates/gdr-testkit/opensandbox/install.sh, or set OPENSANDBOX_PYTHON): {e}",
                        python.display()
                    ),
                )
            })?;
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| std::io::Error::other("no stdin"))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| std::io::Error::other("no stdout"))?;
        // Read the announcement on a thread so a hung start-up meets the deadline.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let result = BufReader::new(stdout).read_line(&mut line).map(|_| line);
            let _ = tx.send(result);
        });
        let failed = |why: String| {
            let mut log = String::new();
            let _ = std::fs::File::open(&log_path).and_then(|mut f| f.read_to_string(&mut log));
            let tail: String = log
                .lines()
                .rev()
                .take(30)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n");
            std::io::Error::other(format!("OpenSandbox server did not start: {why}\n{tail}"))
        };
        let line = match rx.recv_timeout(START_DEADLINE) {
            Ok(Ok(line)) if !line.trim().is_empty() => line,
            Ok(Ok(_)) => {
                let _ = child.kill();
                return Err(failed("it exited".into()));
            }
            Ok(Err(e)) => return Err(failed(e.to_string())),
            Err(_) => {
                let _ = child.kill();
                return Err(failed(format!("no announcement within {START_DEADLINE:?}")));
            }
        };
        let announce: Announce = serde_json::from_str(line.trim())
            .map_err(|e| failed(format!("bad announcement {line:?}: {e}")))?;
        Ok(OpenSandboxServer {
            url: format!("http://127.0.0.1:{}/v1", announce.api_port),
            api_key,
            control: Control {
                base: format!("http://127.0.0.1:{}", announce.control_port),
            },
            _child: child,
            _stdin: stdin,
            workdir,
        })
    }

    /// The server's log (stderr), for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.workdir.path().join("server.log")).unwrap_or_default()
    }
}

/// How a test pool behaves.
#[derive(Debug, Clone)]
pub struct PoolSpec {
    /// Sandboxes that can be allocated at once (`spec.capacitySpec.poolMax`).
    pub capacity: u32,
    /// Time from allocation until ready; `None` holds new sandboxes in `Pending` (their
    /// create keeps blocking) until the pool is put again with a delay.
    pub start_delay: Option<Duration>,
    /// Start the entrypoint as a local process with the sandbox's environment.
    pub spawn: bool,
    /// Pods fail to start: the server answers 500 and deletes the sandbox.
    pub fail_start: bool,
}

impl PoolSpec {
    /// `capacity` sandboxes, ready at once, nothing spawned.
    pub fn new(capacity: u32) -> Self {
        PoolSpec {
            capacity,
            start_delay: Some(Duration::ZERO),
            spawn: false,
            fail_start: false,
        }
    }
}

/// The local process standing in for a sandbox's Pod.
#[derive(Debug, Clone, Deserialize)]
pub struct PodInfo {
    /// Pod name (`<pool>-<n>`).
    pub name: String,
    /// Pod UID.
    pub uid: String,
    /// The entrypoint as started.
    #[serde(default)]
    pub command: Vec<String>,
    /// Its environment.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// Its pid, once started.
    pub pid: Option<u32>,
    /// Its exit code, once it exited.
    pub exit_code: Option<i32>,
    /// Its stdout and stderr.
    pub log: PathBuf,
}

/// A sandbox as the in-memory cluster holds it.
#[derive(Debug, Clone, Deserialize)]
pub struct SandboxInfo {
    /// The `BatchSandbox` object.
    pub batchsandbox: serde_json::Value,
    /// Its Pod, while allocated.
    pub pod: Option<PodInfo>,
}

/// The control API of the in-memory cluster.
#[derive(Debug, Clone)]
pub struct Control {
    base: String,
}

impl Control {
    async fn call(
        &self,
        method: http::Method,
        path: &str,
        body: serde_json::Value,
    ) -> std::io::Result<(u16, serde_json::Value)> {
        // A client per call: tests run on different runtimes, and pooled connections
        // must not outlive the runtime that opened them.
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let request = http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(std::io::Error::other)?;
        let response = client
            .request(request)
            .await
            .map_err(std::io::Error::other)?;
        let status = response.status().as_u16();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(std::io::Error::other)?
            .to_bytes();
        let value = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        Ok((status, value))
    }

    /// Creates or changes a pool; a new start delay applies to sandboxes still starting.
    pub async fn put_pool(&self, name: &str, spec: &PoolSpec) -> std::io::Result<()> {
        let body = serde_json::json!({
            "capacity": spec.capacity,
            "start_delay": spec.start_delay.map(|d| d.as_secs_f64()),
            "spawn": spec.spawn,
            "fail_start": spec.fail_start,
        });
        match self
            .call(http::Method::PUT, &format!("/pools/{name}"), body)
            .await?
        {
            (200, _) => Ok(()),
            (status, body) => Err(std::io::Error::other(format!("put pool: {status} {body}"))),
        }
    }

    /// Deletes a pool.
    pub async fn delete_pool(&self, name: &str) -> std::io::Result<()> {
        self.call(
            http::Method::DELETE,
            &format!("/pools/{name}"),
            serde_json::Value::Null,
        )
        .await
        .map(|_| ())
    }

    /// Fails the sandbox's task (the server then reports `Failed`, `TASK_FAILED`);
    /// `false` when no such sandbox exists.
    pub async fn fail_sandbox(&self, id: &str) -> std::io::Result<bool> {
        let (status, _) = self
            .call(
                http::Method::POST,
                &format!("/sandboxes/{id}/fail"),
                serde_json::Value::Null,
            )
            .await?;
        Ok(status == 200)
    }

    /// Every sandbox of `pool` as the cluster holds it.
    pub async fn sandboxes(&self, pool: &str) -> std::io::Result<Vec<SandboxInfo>> {
        let query: String = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("pool", pool)
            .finish();
        match self
            .call(
                http::Method::GET,
                &format!("/sandboxes?{query}"),
                serde_json::Value::Null,
            )
            .await?
        {
            (200, value) => serde_json::from_value(value).map_err(std::io::Error::other),
            (status, body) => Err(std::io::Error::other(format!(
                "list sandboxes: {status} {body}"
            ))),
        }
    }

    /// The sandbox as the cluster holds it, `None` once it is gone.
    pub async fn sandbox(&self, id: &str) -> std::io::Result<Option<SandboxInfo>> {
        match self
            .call(
                http::Method::GET,
                &format!("/sandboxes/{id}"),
                serde_json::Value::Null,
            )
            .await?
        {
            (200, value) => serde_json::from_value(value)
                .map(Some)
                .map_err(std::io::Error::other),
            _ => Ok(None),
        }
    }
}
