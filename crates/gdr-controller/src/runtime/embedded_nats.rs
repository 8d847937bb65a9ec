//! The embedded single-host NATS server: a supervised `nats-server` child with
//! JetStream, listening on loopback only, its store under the state directory.
//! Production deployments point `nats_url` at a cluster instead.
//!
//! Loopback is not a trust boundary (every local process can connect), so the server
//! requires credentials (DESIGN invariant 21): a producer and a worker user with random
//! passwords, generated at each start into files only the controller's user can read
//! (the store directory is 0700, the files 0600).
//!
//! The server never outlives its controller and never shares its store with another:
//! - It is started through this binary's hidden `exec-bound-to-parent` subcommand, which
//!   arms `PR_SET_PDEATHSIG` (SIGTERM) and then becomes `nats-server` (the signal survives
//!   `execve` for a binary without set-uid). The kernel sends it when the thread that
//!   started the child ends, so a dedicated supervisor thread, which lives exactly as long
//!   as the server is wanted, starts it: a SIGKILLed controller takes its server along.
//! - The controller holds an exclusive lock on `<store>/controller.lock` while it runs,
//!   and records the server's pid in `<store>/nats-server.pid`. A second controller on the
//!   same store is refused; a server left over on the store (from a controller that died
//!   before its parent-death signal was armed, or from an older version without it) is
//!   found through the pid file or its command line, stopped, and only then replaced.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rustix::fs::FlockOperation;
use rustix::process::{Pid, Signal};

/// The hidden subcommand that starts a program bound to the life of its parent (see
/// [`crate::cli::Command::ExecBoundToParent`]).
const EXEC_BOUND_TO_PARENT: &str = "exec-bound-to-parent";
/// The lock a running controller holds on its store.
const LOCK_FILE: &str = "controller.lock";
/// The pid of the store's server.
const PID_FILE: &str = "nats-server.pid";

/// How long the server gets to accept clients after it starts.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Starts that exit at once (the released port was taken meanwhile) before giving up.
const START_ATTEMPTS: u32 = 5;
/// How long a stopped server gets after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// How long to wait for a SIGKILLed server to vanish.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// Pause before restarting a server that exited on its own.
const RESTART_DELAY: Duration = Duration::from_secs(1);
/// Polling a process that is not our child.
const POLL: Duration = Duration::from_millis(20);

/// Why the embedded server could not start.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedNatsError {
    /// A file of the store could not be created, locked or written.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Another controller runs on this store.
    #[error(
        "the NATS store {} is in use by another running controller{}; one store serves one controller",
        .store.display(),
        .holder.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    StoreInUse {
        /// The store directory.
        store: PathBuf,
        /// The other controller, as its lock file records it.
        holder: Option<u32>,
    },
    /// A leftover server on the store could not be stopped.
    #[error("a nats-server left over on {} (pid {pid}) does not stop", .store.display())]
    Leftover {
        /// The store directory.
        store: PathBuf,
        /// The leftover server.
        pid: u32,
    },
    /// The store directory could not be made private.
    #[error("the NATS store: {0}")]
    Store(#[source] crate::runtime::PrivateDirError),
    /// The thread that supervises the server could not be started.
    #[error("starting the supervisor thread: {0}")]
    Supervisor(#[source] std::io::Error),
    /// The supervisor thread ended without a word (it panicked).
    #[error("the supervisor thread ended before the server was ready")]
    SupervisorEnded,
    /// No loopback port could be had for the server.
    #[error("choosing a loopback port for NATS: {0}")]
    Port(#[source] std::io::Error),
    /// The server's program could not be started.
    #[error(
        "starting {} through {} (nats_server_binary): {source}",
        .binary.display(),
        .binder.display()
    )]
    Spawn {
        /// The nats-server program.
        binary: PathBuf,
        /// The program that starts it (binding it to this process's life).
        binder: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The server exited while starting.
    #[error(
        "{} (nats_server_binary) exited at start: {status}; its last stderr lines: {stderr}",
        .binary.display()
    )]
    ExitedAtStart {
        /// The nats-server program.
        binary: PathBuf,
        /// How it ended.
        status: std::process::ExitStatus,
        /// The last lines it wrote to stderr.
        stderr: String,
    },
    /// The server did not accept clients in time.
    #[error("nats-server did not accept clients within {0:?}")]
    NotReady(Duration),
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> EmbeddedNatsError {
    let path = path.to_path_buf();
    move |source| EmbeddedNatsError::Io { what, path, source }
}

/// The users of the embedded server.
const PRODUCER_USER: &str = "gdr-producer";
const WORKER_USER: &str = "gdr-worker";
/// The server's configuration file (credentials, payload limit) in the store.
const CONFIG_FILE: &str = "auth.conf";
/// Largest message the embedded server takes (its default is 1 MiB): a task Gitea hands
/// out can be as large as `gdr_gitea::FETCH_TASK_MESSAGE_LIMIT` (32 MiB), and its envelope is
/// base64 of it, a third larger. 64 MB is nats-server's own upper bound.
const MAX_PAYLOAD: &str = "64MB";

/// How the server is started: the binary, and the program that binds it to this process.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The nats-server binary (`nats_server_binary`).
    pub binary: PathBuf,
    /// A program with the `exec-bound-to-parent` subcommand: this binary.
    pub binder: PathBuf,
}

/// A supervised nats-server; stopped when dropped.
pub struct EmbeddedNats {
    port: u16,
    store: PathBuf,
    shared: Arc<Shared>,
    supervisor: Option<std::thread::JoinHandle<()>>,
    /// Held (flock) while this controller runs; released when dropped.
    _lock: std::fs::File,
}

struct Shared {
    stop: AtomicBool,
    /// The current server's pid (0: none).
    pid: AtomicU32,
    pid_file: PathBuf,
}

impl EmbeddedNats {
    /// Locks the store, stops a server left over on it, starts the server (store in
    /// `store`) and waits until it accepts clients.
    pub async fn start(launch: &Launch, store: &Path) -> Result<Self, EmbeddedNatsError> {
        crate::runtime::private_dir(store).map_err(EmbeddedNatsError::Store)?;
        let lock = lock_store(store)?;
        write_auth(store)?;
        let launch = launch.clone();
        let store = store.to_path_buf();
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            pid: AtomicU32::new(0),
            pid_file: store.join(PID_FILE),
        });
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let thread_shared = shared.clone();
        let thread_store = store.clone();
        // Everything blocking (stopping a leftover, waiting for the child) happens on the
        // supervisor thread; this task only awaits its word.
        let supervisor = std::thread::Builder::new()
            .name("embedded-nats".into())
            .spawn(move || supervise(&launch, &thread_store, &thread_shared, ready_tx))
            .map_err(EmbeddedNatsError::Supervisor)?;
        let mut nats = EmbeddedNats {
            port: 0,
            store: store.clone(),
            shared,
            supervisor: Some(supervisor),
            _lock: lock,
        };
        match ready_rx.await {
            Ok(Ok(port)) => {
                nats.port = port;
                tracing::info!(port, store = %store.display(), "embedded nats-server started");
                Ok(nats)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(EmbeddedNatsError::SupervisorEnded),
        }
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

    /// The current server's pid, if one runs.
    pub fn pid(&self) -> Option<u32> {
        Some(self.shared.pid.load(Ordering::SeqCst)).filter(|p| *p != 0)
    }
}

impl Drop for EmbeddedNats {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(pid) = self.pid() {
            terminate(pid);
        }
        if let Some(thread) = self.supervisor.take() {
            // The supervisor reaps the server and removes the pid file, then ends.
            let deadline = Instant::now() + STOP_GRACE;
            while !thread.is_finished() && Instant::now() < deadline {
                std::thread::sleep(POLL);
            }
            if !thread.is_finished()
                && let Some(pid) = self.pid()
            {
                tracing::warn!(pid, "embedded nats-server ignored SIGTERM; sending SIGKILL");
                signal(pid, Signal::KILL);
            }
            let _ = thread.join();
        }
    }
}

/// Takes the store's lock (non-blocking) and writes this process's pid into it.
fn lock_store(store: &Path) -> Result<std::fs::File, EmbeddedNatsError> {
    let path = store.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(io("opening", &path))?;
    if rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive).is_err() {
        let mut text = String::new();
        let _ = file.read_to_string(&mut text);
        return Err(EmbeddedNatsError::StoreInUse {
            store: store.to_path_buf(),
            holder: text.trim().parse().ok(),
        });
    }
    file.set_len(0).map_err(io("writing", &path))?;
    writeln!(file, "{}", std::process::id()).map_err(io("writing", &path))?;
    Ok(file)
}

/// The supervisor thread: stops leftovers, starts the server, reports readiness once,
/// restarts the server when it exits on its own, and ends when asked to stop.
fn supervise(
    launch: &Launch,
    store: &Path,
    shared: &Shared,
    ready: tokio::sync::oneshot::Sender<Result<u16, EmbeddedNatsError>>,
) {
    if let Err(e) = stop_leftovers(store) {
        let _ = ready.send(Err(e));
        return;
    }
    let (mut child, port) = match first_start(launch, store, shared) {
        Ok(started) => started,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(port));
    loop {
        let status = child.wait();
        shared.pid.store(0, Ordering::SeqCst);
        let _ = std::fs::remove_file(&shared.pid_file);
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        tracing::error!(?status, "embedded nats-server exited; restarting");
        loop {
            std::thread::sleep(RESTART_DELAY);
            if shared.stop.load(Ordering::SeqCst) {
                return;
            }
            match spawn(launch, store, port, shared) {
                Ok(mut next) => {
                    if let Err(e) = wait_ready(&mut next, launch, port) {
                        tracing::error!(error = %e, "embedded nats-server restart failed");
                    }
                    child = next.0;
                    break;
                }
                Err(e) => {
                    tracing::error!(error = %e, "embedded nats-server restart failed; retrying");
                }
            }
        }
    }
}

fn first_start(
    launch: &Launch,
    store: &Path,
    shared: &Shared,
) -> Result<(Child, u16), EmbeddedNatsError> {
    // The port comes from binding :0 and releasing it; another process can take it in
    // between, so a server that exits at start is tried again on a new port.
    let mut attempt = 0;
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(EmbeddedNatsError::Port)?
            .port();
        let mut server = spawn(launch, store, port, shared)?;
        match wait_ready(&mut server, launch, port) {
            Ok(()) => return Ok((server.0, port)),
            Err(e) => {
                let child = &mut server.0;
                let _ = child.kill();
                let _ = child.wait();
                shared.pid.store(0, Ordering::SeqCst);
                let _ = std::fs::remove_file(&shared.pid_file);
                attempt += 1;
                if attempt >= START_ATTEMPTS {
                    return Err(e);
                }
            }
        }
    }
}

/// Writes fresh credentials and the server's configuration into `store` (each file 0600).
fn write_auth(store: &Path) -> Result<(), EmbeddedNatsError> {
    use std::fmt::Write as _;
    let write = |name: &str, content: &str| -> Result<(), EmbeddedNatsError> {
        let path = store.join(name);
        // Replaced, not rewritten in place: a file an older release left 0644 must not
        // keep its mode.
        let _ = std::fs::remove_file(&path);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(io("writing", &path))?;
        file.write_all(content.as_bytes())
            .map_err(io("writing", &path))
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
        CONFIG_FILE,
        &format!(
            "max_payload: {MAX_PAYLOAD}\n\
             authorization {{\n  users = [\n    {{ user: \"{PRODUCER_USER}\", password: \"{producer}\" }}\n    {{ user: \"{WORKER_USER}\", password: \"{worker}\" }}\n  ]\n}}\n"
        ),
    )
}

/// The server's command line (after the binder): its configuration, loopback only,
/// JetStream, this store.
fn server_args(store: &Path, port: u16) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec!["-c".into(), store.join(CONFIG_FILE).into_os_string()];
    args.extend(
        ["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"]
            .iter()
            .map(OsString::from),
    );
    args.push(store.as_os_str().to_owned());
    args
}

/// The last lines a server wrote to its stderr, kept so that a server that exits at start
/// can say why in the error (a pyenv shim, a bad flag); bounded, drained until the end.
#[derive(Default)]
struct StderrTail {
    lines: std::sync::Mutex<std::collections::VecDeque<String>>,
    ended: AtomicBool,
}

/// Lines of a server's stderr kept, and the length kept of each.
const STDERR_LINES: usize = 20;
const STDERR_LINE_CHARS: usize = 512;

impl StderrTail {
    /// Reads `stderr` to its end on a thread of its own.
    fn follow(stderr: std::process::ChildStderr) -> Arc<Self> {
        let tail = Arc::new(StderrTail::default());
        let reader = tail.clone();
        let spawned = std::thread::Builder::new()
            .name("nats-stderr".into())
            .spawn(move || {
                use std::io::BufRead;
                for line in std::io::BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    let mut lines = reader.lines.lock().unwrap_or_else(|p| p.into_inner());
                    if lines.len() == STDERR_LINES {
                        lines.pop_front();
                    }
                    lines.push_back(line.chars().take(STDERR_LINE_CHARS).collect());
                }
                reader.ended.store(true, Ordering::SeqCst);
            });
        if spawned.is_err() {
            tail.ended.store(true, Ordering::SeqCst);
        }
        tail
    }

    /// What the server wrote last, once it has closed its stderr (waiting a little for
    /// that: it exited just now), as one line.
    fn last_lines(&self) -> String {
        let deadline = Instant::now() + Duration::from_millis(500);
        while !self.ended.load(Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        lines.iter().cloned().collect::<Vec<_>>().join(" | ")
    }
}

/// Starts the server through the binder, from this (supervisor) thread, and records its pid.
fn spawn(
    launch: &Launch,
    store: &Path,
    port: u16,
    shared: &Shared,
) -> Result<(Child, Arc<StderrTail>), EmbeddedNatsError> {
    let mut child = Command::new(&launch.binder)
        .arg(EXEC_BOUND_TO_PARENT)
        .arg("--parent")
        .arg(std::process::id().to_string())
        .arg("--")
        .arg(&launch.binary)
        .args(server_args(store, port))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| EmbeddedNatsError::Spawn {
            binary: launch.binary.clone(),
            binder: launch.binder.clone(),
            source,
        })?;
    let tail = match child.stderr.take() {
        Some(stderr) => StderrTail::follow(stderr),
        None => Arc::new(StderrTail::default()),
    };
    shared.pid.store(child.id(), Ordering::SeqCst);
    std::fs::write(&shared.pid_file, format!("{}\n", child.id()))
        .map_err(io("writing", &shared.pid_file))?;
    Ok((child, tail))
}

fn wait_ready(
    (child, tail): &mut (Child, Arc<StderrTail>),
    launch: &Launch,
    port: u16,
) -> Result<(), EmbeddedNatsError> {
    let deadline = Instant::now() + READY_TIMEOUT;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(EmbeddedNatsError::ExitedAtStart {
                binary: launch.binary.clone(),
                status,
                stderr: tail.last_lines(),
            });
        }
        if let Ok(mut stream) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1))
        {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
            let mut greeting = [0u8; 4];
            if stream.read_exact(&mut greeting).is_ok() && &greeting == b"INFO" {
                return Ok(());
            }
        }
        if Instant::now() >= deadline {
            return Err(EmbeddedNatsError::NotReady(READY_TIMEOUT));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Stops every nats-server that serves `store`: the one its pid file names and any other
/// whose command line names the store (a server started before pid files existed).
fn stop_leftovers(store: &Path) -> Result<(), EmbeddedNatsError> {
    let pid_file = store.join(PID_FILE);
    let mut pids = servers_of(store);
    if let Some(recorded) = std::fs::read_to_string(&pid_file)
        .ok()
        .and_then(|t| t.trim().parse::<u32>().ok())
        && serves(recorded, store)
        && !pids.contains(&recorded)
    {
        pids.push(recorded);
    }
    for pid in pids {
        tracing::warn!(pid, store = %store.display(), "stopping a nats-server left over on the store");
        terminate(pid);
        if !gone_within(pid, STOP_GRACE) {
            signal(pid, Signal::KILL);
            if !gone_within(pid, KILL_WAIT) {
                return Err(EmbeddedNatsError::Leftover {
                    store: store.to_path_buf(),
                    pid,
                });
            }
        }
    }
    let _ = std::fs::remove_file(&pid_file);
    Ok(())
}

/// Live processes whose command line serves `store` (`-sd <store>`).
fn servers_of(store: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != std::process::id() && serves(*pid, store))
        .collect()
}

/// Whether `pid` is a live process started with `-sd <store>`.
fn serves(pid: u32, store: &Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let store = store.as_os_str().as_encoded_bytes();
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    alive(pid) && args.windows(2).any(|w| w[0] == b"-sd" && w[1] == store)
}

/// Alive and not a zombie (a zombie is gone for every purpose but its parent's).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rfind(')')
            .and_then(|end| stat[end + 1..].split_whitespace().next())
            .is_some_and(|state| !matches!(state, "Z" | "X" | "x"))
    })
}

fn gone_within(pid: u32, wait: Duration) -> bool {
    let deadline = Instant::now() + wait;
    while alive(pid) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
    true
}

fn terminate(pid: u32) {
    signal(pid, Signal::TERM);
}

fn signal(pid: u32, signal: Signal) {
    // Never 0 or 1 (or a negative group form): only the one process.
    if let Some(pid) = i32::try_from(pid)
        .ok()
        .filter(|p| *p > 1)
        .and_then(Pid::from_raw)
    {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

/// The `exec-bound-to-parent` subcommand: arms the parent-death signal (SIGTERM), checks
/// the parent `parent` is still there (it may have died before the signal was armed), then
/// becomes `program`. Returns only on failure.
pub fn exec_bound_to_parent(parent: u32, program: &[OsString]) -> std::io::Error {
    let Some((binary, args)) = program.split_first() else {
        return std::io::Error::other("no program to run");
    };
    if let Err(e) = rustix::process::set_parent_process_death_signal(Some(Signal::TERM)) {
        return std::io::Error::other(super::in_context("arming the parent-death signal", e));
    }
    let current = rustix::process::getppid().map(|p| p.as_raw_nonzero().get());
    if current.and_then(|p| u32::try_from(p).ok()) != Some(parent) {
        return std::io::Error::other(format!(
            "the parent process {parent} is gone; not starting {}",
            Path::new(binary).display()
        ));
    }
    Command::new(binary).args(args).exec()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One store serves one controller: a second lock on it is refused and names the
    /// holder.
    #[test]
    fn a_second_controller_on_the_same_store_is_refused() {
        let store = tempfile::tempdir().unwrap();
        let _first = lock_store(store.path()).unwrap();
        match lock_store(store.path()) {
            Err(EmbeddedNatsError::StoreInUse { holder, .. }) => {
                assert_eq!(holder, Some(std::process::id()));
            }
            other => panic!("a second lock must fail: {other:?}"),
        }
    }

    /// A process serving another store is never taken for a leftover.
    #[test]
    fn only_processes_naming_the_store_count_as_its_servers() {
        let store = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        // A shell that stays (its command is not its last) keeps `-sd <store>` in argv.
        // Its own process group, so the `sleep` is killed with it and no process of this test
        // outlives it.
        let mut child = Command::new("sh")
            .args(["-c", "sleep 30; :", "sh", "-sd"])
            .arg(store.path())
            .process_group(0)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !servers_of(store.path()).contains(&child.id()) {
            assert!(Instant::now() < deadline, "the child is found by its store");
            std::thread::sleep(POLL);
        }
        assert!(!servers_of(other.path()).contains(&child.id()));
        let group = rustix::process::Pid::from_raw(i32::try_from(child.id()).unwrap()).unwrap();
        let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
        let _ = child.wait();
        assert!(
            !servers_of(store.path()).contains(&child.id()),
            "a reaped child is gone"
        );
    }
}
