//! A stand-in for `dockerd` (no Docker engine on the test machines), and a recording
//! wrapper around the stand-in runner, for the tests of the executor's job Docker daemon.
//!
//! The stand-in daemon is the `dockerd-standin` binary (this crate's [`main`], built with
//! the `testkit` feature) behind a `/bin/sh` wrapper that [`StandinDockerd::install`]
//! writes: nothing here needs python3 or `/usr/bin/env`, which the Nix build sandbox of
//! `checks.nextest` lacks. It takes `--host unix://<socket>` as dockerd does, records its
//! arguments and pid, then — as [`Readiness`] says — answers `GET /_ping` with `200 OK` on
//! the socket (what the Docker CLI and the executor probe), never binds it, or exits at
//! once. On SIGTERM it records that and exits 0, as dockerd's orderly shutdown does.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where the stand-in writes its records (set by the wrapper).
const RECORDS_ENV: &str = "STANDIN_DOCKERD_RECORDS";
/// What the stand-in does (set by the wrapper): `after <ms>`, `never` or `exit <code>`.
const READINESS_ENV: &str = "STANDIN_DOCKERD_READINESS";

/// When the stand-in daemon answers.
#[derive(Debug, Clone, Copy)]
pub enum Readiness {
    /// Binds its socket and answers after this delay.
    After(Duration),
    /// Runs but never binds its socket (a daemon stuck in start-up).
    Never,
    /// Exits with this status before binding (a daemon that cannot start).
    Exits(i32),
}

impl Readiness {
    fn encode(self) -> String {
        match self {
            Readiness::After(d) => format!("after {}", d.as_millis()),
            Readiness::Never => "never".to_string(),
            Readiness::Exits(code) => format!("exit {code}"),
        }
    }

    fn decode(text: &str) -> Option<Self> {
        match text.split_once(' ') {
            Some(("after", ms)) => ms
                .parse()
                .ok()
                .map(|ms| Readiness::After(Duration::from_millis(ms))),
            Some(("exit", code)) => code.parse().ok().map(Readiness::Exits),
            None if text == "never" => Some(Readiness::Never),
            _ => None,
        }
    }
}

/// A stand-in `dockerd` written into a directory, with what it recorded there.
#[derive(Debug, Clone)]
pub struct StandinDockerd {
    dir: PathBuf,
}

impl StandinDockerd {
    /// Writes `dir/dockerd`, a wrapper that runs the `dockerd-standin` binary at
    /// `program` with its records in `dir` (which then holds them).
    pub fn install(dir: &Path, program: &Path, readiness: Readiness) -> std::io::Result<Self> {
        let body = format!(
            "#!/bin/sh\n{RECORDS_ENV}='{records}' {READINESS_ENV}='{readiness}' exec '{program}' \"$@\"\n",
            records = dir.display(),
            readiness = readiness.encode(),
            program = program.display(),
        );
        let wrapper = dir.join("dockerd");
        std::fs::write(&wrapper, body)?;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
        Ok(StandinDockerd {
            dir: dir.to_path_buf(),
        })
    }

    /// The program to start (`CI_DOCKERD`).
    pub fn program(&self) -> PathBuf {
        self.dir.join("dockerd")
    }

    /// The arguments of its last start; `None` if it never started.
    pub fn args(&self) -> Option<Vec<String>> {
        let text = std::fs::read_to_string(self.dir.join("dockerd.args")).ok()?;
        Some(text.lines().map(str::to_string).collect())
    }

    /// Its pid; `None` if it never started.
    pub fn pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.dir.join("dockerd.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Whether it received SIGTERM (the orderly stop).
    pub fn terminated(&self) -> bool {
        self.dir.join("dockerd.terminated").exists()
    }

    /// Whether its process still exists (a zombie counts: nobody waited for it).
    pub fn running(&self) -> bool {
        self.pid()
            .and_then(rustix::process::Pid::from_raw)
            .is_some_and(|pid| rustix::process::test_kill_process(pid).is_ok())
    }
}

/// What a [`recording_runner`] saw when the executor started it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerStart {
    /// Its arguments.
    pub args: Vec<String>,
    /// Its `DOCKER_HOST` (empty when unset).
    pub docker_host: String,
    /// Whether `DOCKER_HOST`'s socket existed at that moment.
    pub socket_existed: bool,
    /// Its uid (`id -u`).
    pub uid: String,
    /// Its gid (`id -g`).
    pub gid: String,
    /// All its groups (`id -G`).
    pub groups: Vec<String>,
}

/// Writes `dir/runner`: a shell wrapper that records its arguments, `DOCKER_HOST`,
/// whether that socket exists and its user and groups into `dir/runner.start`, then runs `standin` with the same
/// arguments. Read the record with [`runner_start`].
pub fn recording_runner(dir: &Path, standin: &Path) -> std::io::Result<PathBuf> {
    let record = dir.join("runner.start");
    let body = format!(
        r#"#!/bin/sh
record='{record}'
{{
  printf 'docker_host=%s\n' "$DOCKER_HOST"
  socket="${{DOCKER_HOST#unix://}}"
  if [ -n "$DOCKER_HOST" ] && [ -S "$socket" ]; then echo socket=yes; else echo socket=no; fi
  printf 'uid=%s\ngid=%s\ngroups=%s\n' "$(id -u)" "$(id -g)" "$(id -G)"
  for arg in "$@"; do printf 'arg=%s\n' "$arg"; done
}} > "$record.tmp"
mv "$record.tmp" "$record"
exec '{standin}' "$@"
"#,
        record = record.display(),
        standin = standin.display(),
    );
    let program = dir.join("runner");
    std::fs::write(&program, body)?;
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755))?;
    Ok(program)
}

/// The record a [`recording_runner`] in `dir` left; `None` if it never started.
pub fn runner_start(dir: &Path) -> Option<RunnerStart> {
    let text = std::fs::read_to_string(dir.join("runner.start")).ok()?;
    let mut start = RunnerStart {
        args: Vec::new(),
        docker_host: String::new(),
        socket_existed: false,
        uid: String::new(),
        gid: String::new(),
        groups: Vec::new(),
    };
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("docker_host=") {
            start.docker_host = v.to_string();
        } else if let Some(v) = line.strip_prefix("socket=") {
            start.socket_existed = v == "yes";
        } else if let Some(v) = line.strip_prefix("uid=") {
            start.uid = v.to_string();
        } else if let Some(v) = line.strip_prefix("gid=") {
            start.gid = v.to_string();
        } else if let Some(v) = line.strip_prefix("groups=") {
            start.groups = v.split_whitespace().map(str::to_string).collect();
        } else if let Some(v) = line.strip_prefix("arg=") {
            start.args.push(v.to_string());
        }
    }
    Some(start)
}

/// The `dockerd-standin` binary: records, then behaves as `STANDIN_DOCKERD_READINESS` says.
/// Exits 2 on a wrong invocation (no records directory, no `--host unix://…`).
pub fn main() -> std::process::ExitCode {
    match run_daemon() {
        Ok(code) => std::process::ExitCode::from(code),
        Err(message) => {
            eprintln!("dockerd-standin: {message}");
            std::process::ExitCode::from(2)
        }
    }
}

fn run_daemon() -> Result<u8, String> {
    let records =
        PathBuf::from(std::env::var_os(RECORDS_ENV).ok_or(format!("{RECORDS_ENV} is unset"))?);
    let readiness = std::env::var(READINESS_ENV)
        .ok()
        .and_then(|r| Readiness::decode(&r))
        .ok_or(format!(
            "{READINESS_ENV} is unset or not `after <ms>`, `never` or `exit <code>`"
        ))?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let write = |name: &str, text: String| {
        std::fs::write(records.join(name), text).map_err(|e| format!("writing {name}: {e}"))
    };
    write("dockerd.args", args.join("\n"))?;
    write("dockerd.pid", std::process::id().to_string())?;
    let socket = args
        .iter()
        .position(|a| a == "--host")
        .and_then(|i| args.get(i + 1))
        .and_then(|h| h.strip_prefix("unix://"))
        .map(PathBuf::from);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    runtime.block_on(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(|e| format!("installing the SIGTERM handler: {e}"))?;
        tokio::select! {
            _ = term.recv() => {
                write("dockerd.terminated", String::new())?;
                Ok(0)
            }
            outcome = behave(readiness, socket) => outcome,
        }
    })
}

/// What the daemon does until SIGTERM: exit, hang, or answer every connection with `OK`.
async fn behave(readiness: Readiness, socket: Option<PathBuf>) -> Result<u8, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let delay = match readiness {
        Readiness::Exits(code) => return Ok(u8::try_from(code).unwrap_or(1)),
        Readiness::Never => return futures::future::pending().await,
        Readiness::After(delay) => delay,
    };
    tokio::time::sleep(delay).await;
    let socket = socket.ok_or("no `--host unix://<socket>` argument")?;
    let listener = tokio::net::UnixListener::bind(&socket)
        .map_err(|e| format!("binding {}: {e}", socket.display()))?;
    loop {
        let (mut conn, _) = listener
            .accept()
            .await
            .map_err(|e| format!("accepting: {e}"))?;
        let mut request = [0_u8; 1024];
        // The request is not parsed: every probe gets dockerd's answer to `GET /_ping`.
        let _ = conn.read(&mut request).await;
        let _ = conn
            .write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nOK")
            .await;
    }
}
