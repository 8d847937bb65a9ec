//! A stand-in for `dockerd` (no Docker engine on the test machines), and a recording
//! wrapper around the stand-in runner, for the tests of the executor's job Docker daemon.
//!
//! The stand-in daemon is a small Python program (python3 is on every test machine: the
//! OpenSandbox tests run Python too). It takes `--host unix://<socket>` as dockerd does,
//! records its arguments and pid, then — as [`Readiness`] says — answers
//! `GET /_ping` with `200 OK` on the socket (what the Docker CLI and the executor probe),
//! never binds it, or exits at once. On SIGTERM it records that and exits 0, as dockerd's
//! orderly shutdown does.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

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

/// A stand-in `dockerd` written into a directory, with what it recorded there.
#[derive(Debug, Clone)]
pub struct StandinDockerd {
    dir: PathBuf,
}

impl StandinDockerd {
    /// Writes the program into `dir` (which then holds its records too).
    pub fn install(dir: &Path, readiness: Readiness) -> std::io::Result<Self> {
        let (delay, exit) = match readiness {
            Readiness::After(d) => (d.as_secs_f64(), None),
            Readiness::Never => (f64::INFINITY, None),
            Readiness::Exits(code) => (0.0, Some(code)),
        };
        let exit = exit.map_or_else(|| "None".to_string(), |c| c.to_string());
        let records = dir.display();
        let body = format!(
            r#"#!/usr/bin/env python3
import os, signal, socket, sys, time
records = "{records}"
args = sys.argv[1:]
with open(os.path.join(records, "dockerd.args"), "w") as f:
    f.write("\n".join(args))
with open(os.path.join(records, "dockerd.pid"), "w") as f:
    f.write(str(os.getpid()))
def term(*_):
    open(os.path.join(records, "dockerd.terminated"), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
if {exit} is not None:
    sys.exit({exit})
delay = float("{delay}")
if delay == float("inf"):
    while True:
        time.sleep(3600)
time.sleep(delay)
path = args[args.index("--host") + 1].removeprefix("unix://")
s = socket.socket(socket.AF_UNIX)
s.bind(path)
s.listen(8)
while True:
    c, _ = s.accept()
    c.recv(1024)
    c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nOK")
    c.close()
"#
        );
        let program = dir.join("dockerd");
        std::fs::write(&program, body)?;
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755))?;
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
