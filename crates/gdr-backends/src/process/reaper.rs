//! Executor processes as the kernel sees them: `/proc` (is our executor still alive, did
//! a stranger reuse its pid), stopping a process group (SIGTERM, then SIGKILL), and the
//! reaper that waits for a child of this instance and records its exit status.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gdr_core::assignment::AssignmentId;
use rustix::process::{Pid, Signal};
use tokio::time::Instant;

use super::store::Durability;
use super::{Inner, OwnChild};

/// How often process state is polled while stopping a process group.
const STOP_POLL: Duration = Duration::from_millis(20);
/// How long to wait for a process group to vanish after SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(5);

impl Inner {
    /// Stops the process group led by `pid` (if it is still ours): SIGTERM, up to
    /// `stop_grace`, then SIGKILL.
    pub(super) async fn stop_group(&self, name: &str, pid: u32, start_time: Option<u64>) {
        let Some(pgid) = signal_target(pid) else {
            tracing::warn!(
                executor = name,
                pid,
                "refusing to signal an implausible pid"
            );
            return;
        };
        // The group ID stays reserved while any member lives, so the group is ours when
        // its leader is gone or is still our leader; a different live leader means the
        // pid was reused and the group belongs to someone else.
        match proc_stat(pid) {
            Some(stat) if Some(stat.start_time) != start_time => {
                tracing::info!(
                    executor = name,
                    pid,
                    "pid reused by another process; not signalling"
                );
                return;
            }
            _ => {}
        }
        if !group_alive(pgid) {
            return;
        }
        signal_group(pgid, Signal::TERM);
        let deadline = Instant::now() + self.settings.stop_grace;
        while group_alive(pgid) && Instant::now() < deadline {
            tokio::time::sleep(STOP_POLL).await;
        }
        if group_alive(pgid) {
            tracing::warn!(executor = name, pid, grace = ?self.settings.stop_grace, "executor ignored SIGTERM; sending SIGKILL");
            signal_group(pgid, Signal::KILL);
            let deadline = Instant::now() + KILL_WAIT;
            while group_alive(pgid) && Instant::now() < deadline {
                tokio::time::sleep(STOP_POLL).await;
            }
            if group_alive(pgid) {
                tracing::error!(
                    executor = name,
                    pid,
                    "executor process group survived SIGKILL"
                );
            }
        }
    }

    /// Watches a child just spawned and recorded: its reaper waits for it and records its
    /// exit status; until then it counts as running.
    pub(super) fn watch_child(
        self: &Arc<Self>,
        name: &str,
        id: &AssignmentId,
        pid: u32,
        start_time: Option<u64>,
        mut child: tokio::process::Child,
    ) {
        let (tx, rx) = tokio::sync::watch::channel(None);
        let reaper = {
            let ctx = ReaperCtx {
                name: name.to_owned(),
                assignment_id: id.clone(),
                pid,
            };
            // Aborted when the backend is dropped, which releases this reference.
            let backend = Arc::clone(self);
            tokio::spawn(async move {
                let status = child.wait().await;
                let code = match status {
                    Ok(s) => s.code().or_else(|| s.signal().map(|sig| 128 + sig)),
                    Err(e) => {
                        tracing::warn!(assignment_id = %ctx.assignment_id, executor = %ctx.name, pid = ctx.pid, error = %e, "waiting for the executor failed; exit status unknown");
                        None
                    }
                };
                tx.send_replace(Some(code));
                tracing::info!(assignment_id = %ctx.assignment_id, executor = %ctx.name, pid = ctx.pid, exit_code = ?code, "executor exited");
                backend.record_exit(&ctx, code).await;
            })
        };
        let mut live = self.live();
        live.spawning.remove(name);
        live.children.insert(
            name.to_owned(),
            OwnChild {
                pid,
                start_time,
                exit: rx,
                reaper,
            },
        );
    }

    async fn record_exit(&self, ctx: &ReaperCtx, code: Option<i32>) {
        let result = self
            .update(&ctx.assignment_id, Durability::CrashConsistent, |meta| {
                if meta.pid != Some(ctx.pid) || meta.exit_code.is_some() {
                    return false;
                }
                meta.exit_code = code;
                code.is_some()
            })
            .await;
        if let Err(e) = result {
            tracing::warn!(assignment_id = %ctx.assignment_id, executor = %ctx.name, pid = ctx.pid, error = %e, "cannot record the executor's exit status");
        }
    }
}

struct ReaperCtx {
    name: String,
    assignment_id: AssignmentId,
    pid: u32,
}

/// The parts of `/proc/<pid>/stat` we need.
pub(super) struct ProcStat {
    pub(super) state: char,
    pub(super) pgrp: i32,
    pub(super) start_time: u64,
}

pub(super) fn proc_stat(pid: u32) -> Option<ProcStat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

fn parse_stat(text: &str) -> Option<ProcStat> {
    // The command name (field 2) may contain spaces and parentheses; it ends at the
    // last ')'. Fields after it start with field 3 (state).
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(ProcStat {
        state: fields.first()?.chars().next()?,
        pgrp: fields.get(2)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

/// The executor a controller spawned but died before recording (killed between the
/// metadata write and the pid write): the process-group leader whose working directory is
/// the executor's `work/` (only this user's processes can be there). Its pid and start time.
pub(super) fn unrecorded_executor(work: &Path) -> Option<(u32, u64)> {
    let work = std::fs::canonicalize(work).ok()?;
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = proc_stat(pid)?;
            let leader = i32::try_from(pid).ok()? == stat.pgrp;
            let here = std::fs::read_link(entry.path().join("cwd")).ok()? == work;
            (leader && here && !exited(stat.state)).then_some((pid, stat.start_time))
        })
}

fn exited(state: char) -> bool {
    matches!(state, 'Z' | 'X' | 'x')
}

/// The pid is alive (`kill(pid, 0)`), not a zombie, and started when ours did.
pub(super) fn process_alive(pid: u32, start_time: u64) -> bool {
    let Some(target) = signal_target(pid).and_then(Pid::from_raw) else {
        return false;
    };
    if rustix::process::test_kill_process(target).is_err() {
        return false;
    }
    proc_stat(pid).is_some_and(|s| !exited(s.state) && s.start_time == start_time)
}

/// A pid that may be signalled: never 0 or 1 or negative, whose group forms would mean
/// "every process".
pub(super) fn signal_target(pid: u32) -> Option<i32> {
    i32::try_from(pid).ok().filter(|p| *p > 1)
}

pub(super) fn signal_group(pgid: i32, signal: Signal) {
    // `pgid > 1` (see `signal_target`), so this names exactly that group.
    if let Some(group) = Pid::from_raw(pgid) {
        let _ = rustix::process::kill_process_group(group, signal);
    }
}

/// Whether any non-exited process is in group `pgid`.
fn group_alive(pgid: i32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|entry| {
        entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
            .and_then(proc_stat)
            .is_some_and(|s| s.pgrp == pgid && !exited(s.state))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_survives_parentheses_in_the_command_name() {
        let line =
            "1234 (a) b (c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 987654 1000 10";
        let stat = parse_stat(line).expect("parses");
        assert_eq!(stat.state, 'S');
        assert_eq!(stat.pgrp, 1234);
        assert_eq!(stat.start_time, 987654);
    }

    #[test]
    fn pids_zero_and_one_are_never_signalled() {
        assert_eq!(signal_target(0), None);
        assert_eq!(signal_target(1), None);
        assert_eq!(signal_target(u32::MAX), None);
        assert_eq!(signal_target(42), Some(42));
    }
}
