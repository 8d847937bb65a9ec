//! One builder for the controller configurations the tests run: a registered runner in a
//! mock Gitea, its credential files, a capability key, single-host defaults (local
//! identity, process backends, the stand-in runner) and whatever a test sets on top. It
//! writes TOML for a controller process, or gives `--set` pairs for an in-process one.
//!
//! A controller process gets its listeners from the test through socket activation
//! (`LISTEN_FDS`, file descriptors 3 and 4): the test binds `127.0.0.1:0` itself and keeps
//! the port across restarts, so nothing picks a port by binding and releasing it.

use std::collections::BTreeMap;
use std::fmt;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use command_fds::{CommandFdExt, FdMapping};

use crate::mock_gitea::RunningMock;

/// A value in the generated TOML.
#[derive(Debug, Clone)]
pub enum Value {
    /// A string.
    Str(String),
    /// An integer.
    Int(i64),
    /// A boolean.
    Bool(bool),
    /// A TOML inline table or array, written as given (`{ large = { limits = … } }`).
    Inline(String),
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // TOML basic strings escape like Rust's Debug for the paths and URLs used here.
            Value::Str(s) => write!(f, "{s:?}"),
            Value::Int(n) => write!(f, "{n}"),
            Value::Bool(b) => write!(f, "{b}"),
            Value::Inline(t) => f.write_str(t),
        }
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Str(s.to_owned())
    }
}

impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::Str(s)
    }
}

impl From<&Path> for Value {
    fn from(p: &Path) -> Self {
        Value::Str(p.display().to_string())
    }
}

impl From<u32> for Value {
    fn from(n: u32) -> Self {
        Value::Int(i64::from(n))
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

/// The capability key every fixture uses (32 bytes).
pub const CAPABILITY_KEY: &str = "0123456789abcdef0123456789abcdef";
/// The facade SPIFFE ID every fixture uses.
pub const FACADE_SPIFFE_ID: &str = "spiffe://example.org/controller";

/// A controller configuration under construction, with its files in a temporary directory.
pub struct ControllerFixture {
    dir: tempfile::TempDir,
    keys: BTreeMap<String, Value>,
}

impl Drop for ControllerFixture {
    fn drop(&mut self) {
        // The controllers' executors run in process groups of their own, so that they
        // outlive a controller crash: they end with the test instead.
        crate::leftovers::end_processes_under(self.dir.path());
    }
}

impl ControllerFixture {
    /// Registers a runner labelled `self-hosted, pod, vm` in `mock`, writes its credentials
    /// and a capability key, and starts from the single-host defaults: local identity,
    /// process backends, `executor_program` and `runner_binary` as given, trust domain
    /// `example.org`, facade ID [`FACADE_SPIFFE_ID`], state under the fixture's directory.
    pub fn new(mock: &RunningMock, executor_program: &Path, runner_binary: &Path) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("gdr")
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create the fixture directory: {e}"));
        let (uuid, token) = mock
            .handle
            .create_runner("ctl", &["self-hosted", "pod", "vm"], false);
        let mut fixture = ControllerFixture {
            dir,
            keys: BTreeMap::new(),
        };
        let uuid_file = fixture.file("secrets/uuid", &uuid);
        let token_file = fixture.file("secrets/token", &token);
        let key_file = fixture.file("secrets/capability", CAPABILITY_KEY);
        let state = fixture.path().join("state");
        fixture = fixture
            .set("gitea_instance_url", mock.url.as_str())
            .set("gitea_runner_uuid_file", uuid_file.as_path())
            .set("gitea_runner_token_file", token_file.as_path())
            .set("runner_facade_capability_key_file", key_file.as_path())
            .set("trust_domain", "example.org")
            .set("runner_facade_spiffe_id", FACADE_SPIFFE_ID)
            .set("local_identity", true)
            .set("pod_backend", "process")
            .set("vm_backend", "process")
            .set("state_dir", state.as_path())
            .set("executor_program", executor_program)
            .set("runner_binary", runner_binary);
        fixture
    }

    /// Sets `key` (a configuration key) to `value`.
    #[must_use]
    pub fn set(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.replace(key, value);
        self
    }

    /// Sets `key` to `value` in place (between two controller processes of one test).
    pub fn replace(&mut self, key: &str, value: impl Into<Value>) {
        self.keys.insert(key.to_owned(), value.into());
    }

    /// The value set for `key`, if any.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.keys.get(key)
    }

    /// Sets the facade URL to the address of the listener the test bound for it.
    #[must_use]
    pub fn facade_at(self, addr: std::net::SocketAddr) -> Self {
        self.set("runner_facade_url", format!("https://{addr}"))
    }

    /// Writes `content` to `relative` under the fixture directory (mode 0600) and returns
    /// its path.
    pub fn file(&self, relative: &str, content: &str) -> PathBuf {
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.dir.path().join(relative);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .unwrap_or_else(|e| panic!("cannot create {}: {e}", parent.display()));
        }
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true).mode(0o600);
        std::io::Write::write_all(
            &mut options
                .open(&path)
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display())),
            content.as_bytes(),
        )
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        path
    }

    /// The fixture's directory (removed when the fixture is dropped).
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `state_dir`.
    pub fn state_dir(&self) -> PathBuf {
        match self.keys.get("state_dir") {
            Some(Value::Str(s)) => PathBuf::from(s),
            _ => self.dir.path().join("state"),
        }
    }

    /// The configuration as TOML.
    pub fn toml(&self) -> String {
        self.keys
            .iter()
            .map(|(k, v)| format!("{k} = {v}\n"))
            .collect()
    }

    /// Writes the TOML to `controller.toml` in the fixture directory and returns its path.
    pub fn write(&self) -> PathBuf {
        self.file("controller.toml", &self.toml())
    }

    /// The configuration as `--set key=value` pairs (for an in-process controller).
    pub fn overrides(&self) -> Vec<String> {
        self.keys
            .iter()
            .map(|(k, v)| match v {
                Value::Str(s) => format!("{k}={s}"),
                other => format!("{k}={other}"),
            })
            .collect()
    }

    /// A `controller` process of `binary` with this configuration (written first), its
    /// facade and health listeners handed over as file descriptors 3 and 4. The caller
    /// keeps its own copies of the listeners, so a restarted controller gets the same
    /// ports. Output goes to `log` (appended) so a failing test can show it.
    pub fn spawn(
        &self,
        binary: &Path,
        facade: &std::net::TcpListener,
        health: &std::net::TcpListener,
        env: &[(&str, &str)],
    ) -> tokio::process::Child {
        let config = self.write();
        let config = config.display().to_string();
        spawn_activated(
            binary,
            &["controller", "--config", &config],
            &[("facade", facade), ("health", health)],
            env,
            &self.path().join("controller.log"),
        )
    }

    /// What the controller processes of this fixture logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.path().join("controller.log")).unwrap_or_default()
    }
}

/// A process of `binary` with `args`, handed `listeners` by socket activation (file
/// descriptors 3, 4, … named by `LISTEN_FDNAMES`, as systemd does) and `env`, logging to
/// `log` (appended). The caller keeps its own copies of the listeners, so a restarted
/// process gets the same ports. Killed when the handle is dropped.
pub fn spawn_activated(
    binary: &Path,
    args: &[&str],
    listeners: &[(&str, &std::net::TcpListener)],
    env: &[(&str, &str)],
    log: &Path,
) -> tokio::process::Child {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", log.display()));
    let err = out
        .try_clone()
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", log.display()));
    let names: Vec<&str> = listeners.iter().map(|(name, _)| *name).collect();
    let mut command = tokio::process::Command::new(binary);
    command
        .args(args)
        .env("LISTEN_FDS", listeners.len().to_string())
        .env("LISTEN_FDNAMES", names.join(":"))
        .env_remove("LISTEN_PID")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .kill_on_drop(true);
    for (k, v) in env {
        command.env(k, v);
    }
    let mappings = listeners
        .iter()
        .zip(3..)
        .map(|((_, l), child_fd)| FdMapping {
            parent_fd: OwnedFd::from(
                l.try_clone()
                    .unwrap_or_else(|e| panic!("cannot duplicate a listener: {e}")),
            ),
            child_fd,
        })
        .collect();
    command
        .fd_mappings(mappings)
        .unwrap_or_else(|e| panic!("cannot hand over the listeners: {e}"));
    command
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()))
}

/// Sends SIGTERM to `child` (a controller drains and exits on it).
pub fn terminate(child: &tokio::process::Child) {
    let pid = child
        .id()
        .and_then(|p| i32::try_from(p).ok())
        .and_then(rustix::process::Pid::from_raw)
        .unwrap_or_else(|| panic!("the process has exited already"));
    rustix::process::kill_process(pid, rustix::process::Signal::TERM)
        .unwrap_or_else(|e| panic!("cannot send SIGTERM: {e}"));
}

/// A loopback listener for a facade or health server, bound by the test.
pub fn listener() -> std::net::TcpListener {
    let l = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap_or_else(|e| panic!("cannot bind a loopback listener: {e}"));
    l.set_nonblocking(true)
        .unwrap_or_else(|e| panic!("cannot make a listener non-blocking: {e}"));
    l
}
