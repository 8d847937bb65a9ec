//! A SPIRE-backed identity for process executors (`executor_identity = "spire"`): instead
//! of our local CA, an existing SPIRE deployment issues each executor's SVID. The
//! controller registers one entry per executor through the `spire-server` CLI on the
//! server's admin socket (`entry create`, `entry show`, `entry delete`), and the executor
//! fetches its SVID from the SPIRE agent's Workload API.
//!
//! SPIRE's `unix` workload attestor tells processes apart by uid, gid, path or binary hash
//! only, and every executor runs the same binary, so each executor runs under a uid of its
//! own, taken from a pool reserved for this ([`UidPool`]); its entry selects `unix:uid:<uid>`.
//! The safety of the whole scheme rests on a uid never serving two jobs' identities:
//! - before a uid is handed out, every entry still selecting it (a crash's leftover) is
//!   deleted and the uid is then kept out of use for the quarantine, and every process still
//!   running as it is killed;
//! - a freed uid stays out of use for the quarantine (longer than the agent's sync
//!   interval), because the agent keeps serving a deleted entry until its next sync;
//! - after a controller restart every uid not held by a re-adopted executor starts in
//!   quarantine, since the in-memory record of when it was freed is gone;
//! - the uid and SPIFFE ID of an executor are recorded in its directory
//!   ([`RECORD_FILE`]) before its entry is created, so provisioning again after a restart
//!   finds the same uid and entry instead of creating a second.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use gdr_core::executor::ExecutorError;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::process::{IdentityProvider, Provisioned, RunAs};

/// The file in an executor's directory recording its uid and SPIFFE ID (root-owned 0600).
pub const RECORD_FILE: &str = "spire-identity.json";
/// A bound on one `spire-server` CLI call (it answers in milliseconds on a healthy server).
const CLI_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the processes of a uid are looked for and killed before it is handed out: a
/// process may fork while it is being killed.
const KILL_ROUNDS: usize = 10;

/// Why a SPIRE operation failed.
#[derive(Debug, thiserror::Error)]
pub enum SpireError {
    /// The CLI could not be started or waited for.
    #[error("cannot run {}: {source}", program.display())]
    Run {
        /// The program.
        program: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The CLI did not answer in time.
    #[error("`{command}` did not answer within {CLI_TIMEOUT:?}")]
    Timeout {
        /// The command line.
        command: String,
    },
    /// The CLI failed.
    #[error("`{command}` failed: {output}")]
    Failed {
        /// The command line.
        command: String,
        /// Its standard output and error.
        output: String,
    },
    /// `entry show -output json` printed something else than the entries.
    #[error("`{command}` printed no entry list: {source}")]
    Json {
        /// The command line.
        command: String,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// The record of an executor's uid cannot be read or written.
    #[error("the SPIRE record {}: {source}", path.display())]
    Record {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A recorded uid is outside the pool or held by another executor.
    #[error("{0}")]
    Pool(#[source] PoolError),
}

impl From<SpireError> for ExecutorError {
    fn from(e: SpireError) -> Self {
        match e {
            SpireError::Pool(PoolError::Exhausted { retry_after, .. }) => ExecutorError::Full {
                retry_after,
                source: Box::new(e),
            },
            e => ExecutorError::unavailable(e),
        }
    }
}

/// Why the pool could not give a uid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// Every uid is held or in quarantine.
    #[error("every uid of spire_executor_uids ({size}) is in use or in quarantine")]
    Exhausted {
        /// How many uids the pool has.
        size: usize,
        /// When the first quarantine ends, if any uid is in quarantine.
        retry_after: Option<Duration>,
    },
    /// A recorded uid is not in the pool (the pool was changed under a running executor).
    #[error("uid {0} is not in spire_executor_uids")]
    OutOfRange(u32),
    /// A recorded uid is held by another executor.
    #[error("uid {uid} is held by {holder}")]
    Taken {
        /// The uid.
        uid: u32,
        /// Its holder (an executor directory).
        holder: String,
    },
}

/// The uids executors run as: each held by at most one executor, and a freed uid kept out
/// of use for `quarantine`. Time is passed in, so tests control the clock.
#[derive(Debug)]
pub struct UidPool {
    range: RangeInclusive<u32>,
    quarantine: Duration,
    /// uid → the executor (directory) holding it.
    held: BTreeMap<u32, String>,
    /// uid → when it was freed (in quarantine until then plus `quarantine`).
    freed: BTreeMap<u32, Instant>,
}

impl UidPool {
    /// A pool over `range` whose uids all start in quarantine at `now`: after a restart
    /// nothing says when each was last freed.
    pub fn new(range: RangeInclusive<u32>, quarantine: Duration, now: Instant) -> UidPool {
        let freed = range.clone().map(|uid| (uid, now)).collect();
        UidPool {
            range,
            quarantine,
            held: BTreeMap::new(),
            freed,
        }
    }

    /// How many uids the pool has.
    pub fn size(&self) -> usize {
        usize::try_from(
            (u64::from(*self.range.end()) + 1).saturating_sub(u64::from(*self.range.start())),
        )
        .unwrap_or(usize::MAX)
    }

    /// The uid `owner` holds, if any.
    pub fn held_by(&self, owner: &str) -> Option<u32> {
        self.held
            .iter()
            .find_map(|(uid, o)| (o == owner).then_some(*uid))
    }

    /// Gives `owner` a uid: the one it holds, else the lowest neither held nor in quarantine.
    pub fn allocate(&mut self, owner: &str, now: Instant) -> Result<u32, PoolError> {
        if let Some(uid) = self.held_by(owner) {
            return Ok(uid);
        }
        let quarantine = self.quarantine;
        let free = self.range.clone().find(|uid| {
            !self.held.contains_key(uid)
                && self
                    .freed
                    .get(uid)
                    .is_none_or(|at| now.saturating_duration_since(*at) >= quarantine)
        });
        match free {
            Some(uid) => {
                self.freed.remove(&uid);
                self.held.insert(uid, owner.to_owned());
                Ok(uid)
            }
            None => Err(PoolError::Exhausted {
                size: self.size(),
                retry_after: self
                    .freed
                    .values()
                    .map(|at| (*at + quarantine).saturating_duration_since(now))
                    .min(),
            }),
        }
    }

    /// Records that `owner` holds `uid` (an executor re-adopted after a restart, or one
    /// being revoked), whatever its quarantine: its processes may already run as it.
    pub fn claim(&mut self, uid: u32, owner: &str) -> Result<(), PoolError> {
        if !self.range.contains(&uid) {
            return Err(PoolError::OutOfRange(uid));
        }
        match self.held.get(&uid) {
            Some(holder) if holder != owner => Err(PoolError::Taken {
                uid,
                holder: holder.clone(),
            }),
            _ => {
                self.freed.remove(&uid);
                self.held.insert(uid, owner.to_owned());
                Ok(())
            }
        }
    }

    /// Frees `uid` if `owner` holds it; it stays in quarantine from `now`.
    pub fn release(&mut self, uid: u32, owner: &str, now: Instant) {
        if self.held.get(&uid).is_some_and(|holder| holder == owner) {
            self.held.remove(&uid);
            self.freed.insert(uid, now);
        }
    }
}

/// The `spire-server` CLI on the server's admin socket.
#[derive(Debug, Clone)]
pub struct SpireServerCli {
    /// The `spire-server` program.
    pub program: PathBuf,
    /// The server's admin API socket (`server.socket_path`).
    pub socket: PathBuf,
}

/// A registration entry as far as this provider cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryRef {
    /// The entry ID.
    pub id: String,
    /// Its SPIFFE ID.
    pub spiffe_id: String,
    /// Its parent ID.
    pub parent_id: String,
}

/// The selector of a uid's entry.
pub fn uid_selector(uid: u32) -> String {
    format!("unix:uid:{uid}")
}

impl SpireServerCli {
    fn socket_args(&self) -> Vec<OsString> {
        vec!["-socketPath".into(), self.socket.clone().into_os_string()]
    }

    /// `entry create -socketPath S -parentID P -spiffeID ID -selector unix:uid:U`.
    pub fn create_args(&self, spiffe_id: &str, parent_id: &str, uid: u32) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec!["entry".into(), "create".into()];
        args.extend(self.socket_args());
        for (flag, value) in [
            ("-parentID", parent_id.to_owned()),
            ("-spiffeID", spiffe_id.to_owned()),
            ("-selector", uid_selector(uid)),
        ] {
            args.push(flag.into());
            args.push(value.into());
        }
        args
    }

    /// `entry show -socketPath S -selector unix:uid:U -output json`: every entry whose
    /// selectors include the uid's.
    pub fn show_args(&self, uid: u32) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec!["entry".into(), "show".into()];
        args.extend(self.socket_args());
        args.extend(["-selector".into(), uid_selector(uid).into()]);
        args.extend(["-output".into(), "json".into()]);
        args
    }

    /// `entry delete -socketPath S -entryID E`.
    pub fn delete_args(&self, entry_id: &str) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec!["entry".into(), "delete".into()];
        args.extend(self.socket_args());
        args.extend(["-entryID".into(), entry_id.into()]);
        args
    }

    /// The entries selecting `uid`.
    pub async fn entries_for_uid(&self, uid: u32) -> Result<Vec<EntryRef>, SpireError> {
        let args = self.show_args(uid);
        let out = self.run(&args).await?;
        parse_entries(&out).map_err(|source| SpireError::Json {
            command: self.command_line(&args),
            source,
        })
    }

    /// Creates the entry of `spiffe_id` for `uid` under `parent_id`.
    pub async fn create(
        &self,
        spiffe_id: &str,
        parent_id: &str,
        uid: u32,
    ) -> Result<(), SpireError> {
        self.run(&self.create_args(spiffe_id, parent_id, uid))
            .await
            .map(drop)
    }

    /// Deletes entry `id`.
    pub async fn delete(&self, id: &str) -> Result<(), SpireError> {
        self.run(&self.delete_args(id)).await.map(drop)
    }

    fn command_line(&self, args: &[OsString]) -> String {
        let args: Vec<_> = args.iter().map(|a| a.to_string_lossy()).collect();
        format!("{} {}", self.program.display(), args.join(" "))
    }

    async fn run(&self, args: &[OsString]) -> Result<String, SpireError> {
        let child = tokio::process::Command::new(&self.program)
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(CLI_TIMEOUT, child)
            .await
            .map_err(|_| SpireError::Timeout {
                command: self.command_line(args),
            })?
            .map_err(|source| SpireError::Run {
                program: self.program.clone(),
                source,
            })?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            return Ok(stdout);
        }
        Err(SpireError::Failed {
            command: self.command_line(args),
            output: format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)),
        })
    }
}

/// The entries of `entry show -output json` (IDs as trust domain and path).
pub fn parse_entries(json: &str) -> Result<Vec<EntryRef>, serde_json::Error> {
    #[derive(Deserialize)]
    struct Id {
        trust_domain: String,
        path: String,
    }
    #[derive(Deserialize)]
    struct Entry {
        id: String,
        spiffe_id: Id,
        parent_id: Id,
    }
    #[derive(Deserialize)]
    struct Shown {
        // SPIRE omits the list when no entry matches.
        #[serde(default)]
        entries: Option<Vec<Entry>>,
    }
    let shown: Shown = serde_json::from_str(json)?;
    let id = |i: Id| format!("spiffe://{}{}", i.trust_domain, i.path);
    Ok(shown
        .entries
        .unwrap_or_default()
        .into_iter()
        .map(|e| EntryRef {
            id: e.id,
            spiffe_id: id(e.spiffe_id),
            parent_id: id(e.parent_id),
        })
        .collect())
}

/// What [`RECORD_FILE`] holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Record {
    uid: u32,
    spiffe_id: String,
}

/// Configuration of a [`SpireIdentity`].
#[derive(Debug, Clone)]
pub struct SpireIdentitySettings {
    /// The server CLI.
    pub server: SpireServerCli,
    /// The parent ID of every entry: the SPIFFE ID of the agent on this host.
    pub agent_id: String,
    /// The agent's Workload API as executors get it in `SPIFFE_ENDPOINT_SOCKET`.
    pub endpoint: String,
    /// The uids executors run as (reserved for this: their processes are killed).
    pub uids: RangeInclusive<u32>,
    /// How long a freed uid stays out of use (longer than the agent's sync interval).
    pub quarantine: Duration,
}

/// Executors' identities registered in an existing SPIRE server, each executor under a uid
/// of its own from the pool.
pub struct SpireIdentity {
    settings: SpireIdentitySettings,
    pool: Mutex<UidPool>,
}

impl SpireIdentity {
    /// A provider whose uids all start in quarantine (see the module documentation).
    pub fn new(settings: SpireIdentitySettings) -> SpireIdentity {
        let pool = UidPool::new(settings.uids.clone(), settings.quarantine, Instant::now());
        SpireIdentity {
            settings,
            pool: Mutex::new(pool),
        }
    }

    fn pool(&self) -> MutexGuard<'_, UidPool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh uid for `owner` whose leftovers (entries, processes) are gone. A uid that
    /// had an entry goes back into quarantine: the agent may still serve that entry.
    async fn fresh_uid(&self, owner: &str) -> Result<u32, SpireError> {
        loop {
            let uid = self
                .pool()
                .allocate(owner, Instant::now())
                .map_err(SpireError::Pool)?;
            kill_processes_of(uid).await;
            let stale = self.settings.server.entries_for_uid(uid).await;
            let stale = match stale {
                Ok(stale) => stale,
                Err(e) => {
                    self.pool().release(uid, owner, Instant::now());
                    return Err(e);
                }
            };
            if stale.is_empty() {
                return Ok(uid);
            }
            for entry in &stale {
                tracing::warn!(uid, entry_id = %entry.id, spiffe_id = %entry.spiffe_id, "deleting a leftover SPIRE entry of a uid about to be handed out; the uid goes into quarantine");
                if let Err(e) = self.settings.server.delete(&entry.id).await {
                    self.pool().release(uid, owner, Instant::now());
                    return Err(e);
                }
            }
            self.pool().release(uid, owner, Instant::now());
        }
    }

    /// Makes the entries of `uid` exactly one: `spiffe_id` under the agent.
    async fn ensure_entry(&self, uid: u32, spiffe_id: &str) -> Result<(), SpireError> {
        let server = &self.settings.server;
        let parent = &self.settings.agent_id;
        let mut found = false;
        for entry in server.entries_for_uid(uid).await? {
            if !found && entry.spiffe_id == spiffe_id && &entry.parent_id == parent {
                found = true;
            } else {
                tracing::warn!(uid, entry_id = %entry.id, spiffe_id = %entry.spiffe_id, "deleting a SPIRE entry of an executor's uid that is not its own");
                server.delete(&entry.id).await?;
            }
        }
        if !found {
            server.create(spiffe_id, parent, uid).await?;
        }
        Ok(())
    }

    async fn provision_record(&self, dir: &Path, spiffe_id: &str) -> Result<u32, SpireError> {
        let owner = dir.display().to_string();
        let record_path = dir.join(RECORD_FILE);
        let uid = match read_record(&record_path)? {
            Some(record) => {
                self.pool()
                    .claim(record.uid, &owner)
                    .map_err(SpireError::Pool)?;
                record.uid
            }
            None => {
                let uid = self.fresh_uid(&owner).await?;
                // Recorded before the entry exists: a restart finds the uid again.
                let record = Record {
                    uid,
                    spiffe_id: spiffe_id.to_owned(),
                };
                if let Err(e) = write_record(&record_path, &record) {
                    self.pool().release(uid, &owner, Instant::now());
                    return Err(e);
                }
                uid
            }
        };
        self.ensure_entry(uid, spiffe_id).await?;
        Ok(uid)
    }
}

#[async_trait]
impl IdentityProvider for SpireIdentity {
    async fn provision(&self, dir: &Path, spiffe_id: &str) -> Result<Provisioned, ExecutorError> {
        let uid = self.provision_record(dir, spiffe_id).await?;
        tracing::info!(uid, spiffe_id, dir = %dir.display(), "SPIRE entry registered for the executor");
        Ok(Provisioned {
            endpoint: self.settings.endpoint.clone(),
            // The pool's uids have no group of their own: the gid is the uid's number.
            run_as: Some(RunAs { uid, gid: uid }),
        })
    }

    async fn revoke(&self, dir: &Path) {
        let owner = dir.display().to_string();
        let record = match read_record(&dir.join(RECORD_FILE)) {
            Ok(Some(record)) => record,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot read the executor's SPIRE record; its uid's entries go when the uid is next handed out");
                return;
            }
        };
        // Held by another executor: this one's entries were deleted when it was handed on.
        if let Err(e) = self.pool().claim(record.uid, &owner) {
            tracing::info!(dir = %dir.display(), error = %e, "not revoking a uid handed on");
            return;
        }
        kill_processes_of(record.uid).await;
        let deleted = async {
            for entry in self.settings.server.entries_for_uid(record.uid).await? {
                self.settings.server.delete(&entry.id).await?;
            }
            Ok::<_, SpireError>(())
        }
        .await;
        match deleted {
            Ok(()) => {
                tracing::info!(uid = record.uid, spiffe_id = %record.spiffe_id, "SPIRE entry of the executor deleted")
            }
            // Safe all the same: entries of a uid are deleted before it is handed out again.
            Err(e) => {
                tracing::warn!(uid = record.uid, error = %e, "cannot delete the executor's SPIRE entry; it goes when the uid is next handed out")
            }
        }
        self.pool().release(record.uid, &owner, Instant::now());
    }
}

fn read_record(path: &Path) -> Result<Option<Record>, SpireError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(SpireError::Record {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| SpireError::Record {
            path: path.to_path_buf(),
            source: io::Error::other(e),
        })
}

fn write_record(path: &Path, record: &Record) -> Result<(), SpireError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let error = |source| SpireError::Record {
        path: path.to_path_buf(),
        source,
    };
    let bytes = serde_json::to_vec(record).map_err(|e| error(io::Error::other(e)))?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(error)?;
    file.write_all(&bytes).map_err(error)?;
    file.sync_all().map_err(error)
}

/// Kills every process running as `uid` (real, effective, saved or file-system uid): a
/// job's process that escaped its executor's process group would otherwise get the next
/// job's identity under the same uid. Repeated, since one may fork meanwhile.
async fn kill_processes_of(uid: u32) {
    for _ in 0..KILL_ROUNDS {
        let pids = processes_of(uid);
        if pids.is_empty() {
            return;
        }
        for pid in pids {
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tracing::error!(uid, "processes of an executor uid survived SIGKILL");
}

fn processes_of(uid: u32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let status = std::fs::read_to_string(entry.path().join("status")).ok()?;
            uids_of(&status)
                .is_some_and(|uids| uids.contains(&uid))
                .then_some(pid)
                .filter(|pid| *pid > 1)
        })
        .collect()
}

/// The four uids of a `/proc/<pid>/status` (`Uid:\treal\teffective\tsaved\tfs`).
fn uids_of(status: &str) -> Option<Vec<u32>> {
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    line.split_whitespace().map(|u| u.parse().ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const Q: Duration = Duration::from_secs(30);

    fn pool_after_start(range: RangeInclusive<u32>) -> (UidPool, Instant) {
        let start = Instant::now();
        (UidPool::new(range, Q, start), start + Q)
    }

    #[test]
    fn after_a_start_every_uid_is_in_quarantine_until_it_has_passed() {
        let start = Instant::now();
        let mut pool = UidPool::new(5000..=5001, Q, start);
        let early = pool.allocate("a", start + Q / 2);
        assert_eq!(
            early,
            Err(PoolError::Exhausted {
                size: 2,
                retry_after: Some(Q / 2)
            })
        );
        assert_eq!(pool.allocate("a", start + Q), Ok(5000));
    }

    #[test]
    fn a_uid_is_never_held_by_two_executors_at_once() {
        let (mut pool, now) = pool_after_start(5000..=5002);
        let a = pool.allocate("a", now).expect("a");
        let b = pool.allocate("b", now).expect("b");
        let c = pool.allocate("c", now).expect("c");
        assert_eq!([a, b, c], [5000, 5001, 5002]);
        assert!(matches!(
            pool.allocate("d", now),
            Err(PoolError::Exhausted { size: 3, .. })
        ));
        assert_eq!(
            pool.allocate("a", now),
            Ok(a),
            "the holder gets its own uid again"
        );
        assert_eq!(
            pool.claim(a, "d"),
            Err(PoolError::Taken {
                uid: a,
                holder: "a".into()
            })
        );
        assert_eq!(pool.claim(4999, "d"), Err(PoolError::OutOfRange(4999)));
    }

    #[test]
    fn a_freed_uid_stays_out_of_use_for_the_quarantine() {
        let (mut pool, now) = pool_after_start(5000..=5000);
        let uid = pool.allocate("a", now).expect("a");
        pool.release(uid, "someone else", now);
        assert!(
            pool.allocate("b", now).is_err(),
            "only its holder frees a uid"
        );
        pool.release(uid, "a", now);
        let second = Duration::from_secs(1);
        assert_eq!(
            pool.allocate("b", now + Q - second),
            Err(PoolError::Exhausted {
                size: 1,
                retry_after: Some(second)
            })
        );
        assert_eq!(pool.allocate("b", now + Q), Ok(uid));
    }

    #[test]
    fn a_re_adopted_executor_keeps_its_uid_even_in_quarantine() {
        let start = Instant::now();
        let mut pool = UidPool::new(5000..=5001, Q, start);
        pool.claim(5001, "a").expect("claim");
        assert_eq!(pool.held_by("a"), Some(5001));
        assert_eq!(pool.allocate("b", start + Q), Ok(5000));
        assert!(pool.allocate("c", start + Q).is_err());
    }

    #[test]
    fn the_cli_calls_name_the_socket_the_agent_as_parent_and_the_uid_selector() {
        let cli = SpireServerCli {
            program: "spire-server".into(),
            socket: "/run/spire/server.sock".into(),
        };
        let strings = |args: Vec<OsString>| -> Vec<String> {
            args.into_iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(
            strings(cli.create_args("spiffe://td/job", "spiffe://td/agent", 5003)),
            [
                "entry",
                "create",
                "-socketPath",
                "/run/spire/server.sock",
                "-parentID",
                "spiffe://td/agent",
                "-spiffeID",
                "spiffe://td/job",
                "-selector",
                "unix:uid:5003"
            ]
        );
        assert_eq!(
            strings(cli.show_args(5003)),
            [
                "entry",
                "show",
                "-socketPath",
                "/run/spire/server.sock",
                "-selector",
                "unix:uid:5003",
                "-output",
                "json"
            ]
        );
        assert_eq!(
            strings(cli.delete_args("e-1")),
            [
                "entry",
                "delete",
                "-socketPath",
                "/run/spire/server.sock",
                "-entryID",
                "e-1"
            ]
        );
    }

    #[test]
    fn entries_are_read_from_the_servers_json_and_none_is_an_empty_list() {
        let json = r#"{"entries":[{"id":"e-1","spiffe_id":{"trust_domain":"td","path":"/job"},
            "parent_id":{"trust_domain":"td","path":"/agent"},"selectors":[]}],"next_page_token":""}"#;
        assert_eq!(
            parse_entries(json).expect("parses"),
            [EntryRef {
                id: "e-1".into(),
                spiffe_id: "spiffe://td/job".into(),
                parent_id: "spiffe://td/agent".into(),
            }]
        );
        assert_eq!(parse_entries("{}").expect("parses"), []);
        assert!(parse_entries("Found 0 entries").is_err());
    }

    #[test]
    fn the_uids_of_a_process_are_read_from_its_status() {
        let status = "Name:\tsh\nUid:\t5000\t5000\t5000\t5000\nGid:\t0\t0\t0\t0\n";
        assert_eq!(uids_of(status), Some(vec![5000; 4]));
        assert_eq!(uids_of("Name:\tsh\n"), None);
    }
}
