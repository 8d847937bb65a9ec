//! The job's environment, prepared as root inside its Pod or VM, as the Go image's hook
//! prepared it (docs/executor.md, "Started as root").
//!
//! The executor image marks its executor as the one of a Pod or VM
//! (`CI_EXECUTOR_SANDBOXED=true`) and starts it as root; the runner's uid is
//! `CI_RUNNER_UID` (2000 from the image, `pod_executor_uid` in a Pod). The root executor
//! then only
//! 1. prepares what the job's Docker daemon needs — `/var/lib/docker` on a loop-backed
//!    ext4 file where its file system cannot hold overlay (a Kata guest's shared root
//!    file system), creating `/dev/loop-control` and `/dev/loop0`–`7` where the guest has
//!    none; cgroup v2 nesting: every process of the root cgroup moves to a child cgroup so
//!    that the root cgroup can delegate its controllers (as the official `docker:dind`
//!    entrypoint does) — and puts the SPIRE agent's socket at the path jobs use,
//!    [`AGENT_SOCKET`];
//! 2. starts dockerd and waits until it answers;
//! 3. starts the executor again (the same program) as the runner's uid, gid and the
//!    `docker` group — everything network-facing (SVID, proxy, runner, job) runs as that
//!    user from its first instruction — and then only waits for it, passes SIGTERM/SIGINT
//!    on, and stops dockerd after it. Its exit status is the unprivileged executor's.
//!
//! The SVID is fetched by the unprivileged executor: a VM's identity entry selects
//! `unix:uid:<runner uid>`, so the executor and the job's own `spire-agent api fetch jwt`
//! get the job's identity, and root does not.
//!
//! In a privileged Pod the daemon is the `dockerd` sidecar's (issue 37 item 3): that
//! container runs this program with `CI_EXECUTOR_DOCKERD_ONLY` ([`run_daemon`]: the
//! storage and cgroup steps, then dockerd), and the executor's container gets
//! `CI_DOCKER_EXTERNAL`, so step 1 leaves Docker alone and step 2 only waits for the
//! daemon: the executor and the job stay in their container's cgroup, whose path is
//! what SPIRE's `k8s` attestor reads their container's ID from.
//!
//! Nothing here runs outside a Pod or VM: only the image sets `CI_EXECUTOR_SANDBOXED`
//! (no backend does; the process backend removes it), and an executor that is not root
//! runs as it was started.
//!
//! What to do is decided by [`plan`] from the [`Facts`] read from the system, a pure
//! function; each [`Step`] is one thin privileged action.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;

use rustix::process::{Pid, Signal};

use crate::docker::{DockerError, DockerSettings, Dockerd};
use crate::forward::Forward;

/// `CI_EXECUTOR_SANDBOXED`: `true` in the executor image only: this executor is its Pod's
/// or VM's own and, started as root, prepares that environment.
pub const SANDBOXED: &str = "CI_EXECUTOR_SANDBOXED";
/// `CI_RUNNER_UID`: the uid the job runs as when the executor starts as root (default
/// 2000, the image's runner user).
pub const RUNNER_UID: &str = "CI_RUNNER_UID";
/// `CI_RUNNER_GID`: its gid (default: the uid).
pub const RUNNER_GID: &str = "CI_RUNNER_GID";
/// `CI_DOCKER_STORAGE_SIZE`: size of the loop-backed Docker storage (default `20G`).
pub const DOCKER_STORAGE_SIZE: &str = "CI_DOCKER_STORAGE_SIZE";
/// Set by the root executor for the one it starts: `<uid>:<gid>:<group>,<group>…`, the
/// identity to take before anything else.
pub const RUN_AS: &str = "CI_EXECUTOR_RUN_AS";
/// Where jobs reach the SPIRE agent (the Go image's path, used by existing workflows as
/// `spire-agent api fetch jwt -socketPath /run/spire/agent-sockets/spire-agent.sock`).
pub const AGENT_SOCKET: &str = "/run/spire/agent-sockets/spire-agent.sock";
/// `CI_EXECUTOR_DOCKERD_ONLY`: `true` in a privileged Pod's `dockerd` sidecar: the
/// program runs the job's Docker daemon only (no job, no identity): as root in the image
/// it prepares Docker's storage and cgroups first, then runs dockerd until SIGTERM.
pub const DOCKERD_ONLY: &str = "CI_EXECUTOR_DOCKERD_ONLY";
/// The group whose gid the job gets as a supplementary group (dockerd gives it its socket).
pub const DOCKER_GROUP: &str = "docker";

const DEFAULT_STORAGE_SIZE: u64 = 20 << 30;
/// `/dev/loop0` to `/dev/loop7`, as the Go image's hook created them.
const LOOP_NODES: u32 = 8;
/// The child cgroup the root cgroup's processes move to (the name `docker:dind` uses).
const INIT_CGROUP: &str = "init";

/// Where things are; [`Paths::system`] in production, temporary directories in tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paths {
    /// The device directory.
    pub dev: PathBuf,
    /// The cgroup v2 mount.
    pub cgroup: PathBuf,
    /// dockerd's data root.
    pub docker_data: PathBuf,
    /// The file backing loop storage.
    pub docker_image: PathBuf,
    /// Where jobs reach the SPIRE agent.
    pub agent_socket: PathBuf,
    /// The group database.
    pub group_file: PathBuf,
}

impl Paths {
    /// The paths of a Pod's or VM's system.
    pub fn system() -> Self {
        Paths {
            dev: "/dev".into(),
            cgroup: "/sys/fs/cgroup".into(),
            docker_data: "/var/lib/docker".into(),
            docker_image: "/var/lib/docker.img".into(),
            agent_socket: AGENT_SOCKET.into(),
            group_file: "/etc/group".into(),
        }
    }
}

/// The identity the unprivileged executor takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunAs {
    /// uid.
    pub uid: u32,
    /// Primary gid.
    pub gid: u32,
    /// Supplementary groups (the `docker` group).
    pub groups: Vec<u32>,
}

impl RunAs {
    /// The [`RUN_AS`] value.
    pub fn encode(&self) -> String {
        let groups: Vec<String> = self.groups.iter().map(u32::to_string).collect();
        format!("{}:{}:{}", self.uid, self.gid, groups.join(","))
    }

    /// Parses a [`RUN_AS`] value.
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.trim().splitn(3, ':');
        let uid = parts.next()?.parse().ok()?;
        let gid = parts.next()?.parse().ok()?;
        let groups = match parts.next() {
            None | Some("") => Vec::new(),
            Some(list) => list
                .split(',')
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()?,
        };
        Some(RunAs { uid, gid, groups })
    }
}

/// The gid of `name` in an `/etc/group` text.
pub fn group_gid(group_file: &str, name: &str) -> Option<u32> {
    group_file.lines().find_map(|line| {
        let mut fields = line.split(':');
        (fields.next()? == name).then_some(())?;
        fields.nth(1)?.trim().parse().ok()
    })
}

/// Why the root executor could not prepare the job's environment.
#[derive(Debug, thiserror::Error)]
pub enum JobEnvError {
    /// A variable is invalid.
    #[error("{name}: {problem}")]
    Env {
        /// The variable.
        name: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// A privileged step failed.
    #[error("preparing the job's environment: {what}: {source}")]
    Step {
        /// The step.
        what: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A program of a step failed.
    #[error("preparing the job's environment: {command} failed: {status}")]
    Program {
        /// The command line.
        command: String,
        /// Its status and output.
        status: String,
    },
    /// The job's Docker daemon could not be started.
    #[error(transparent)]
    Docker(#[from] DockerError),
    /// Taking the runner's identity failed.
    #[error("taking uid {uid}, gid {gid}, groups {groups:?}: {source}")]
    Drop {
        /// uid.
        uid: u32,
        /// gid.
        gid: u32,
        /// Supplementary groups.
        groups: Vec<u32>,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The unprivileged executor could not be started or waited for.
    #[error("the unprivileged executor: {0}")]
    Child(#[source] std::io::Error),
}

fn step_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> JobEnvError {
    let what = what.into();
    move |source| JobEnvError::Step { what, source }
}

/// What the root executor was asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootConfig {
    /// `CI_RUNNER_UID` / `CI_RUNNER_GID`.
    pub uid: u32,
    /// The runner's gid.
    pub gid: u32,
    /// The job's Docker daemon (`CI_RUNNER_START_DOCKER`, default on here).
    pub docker: Option<DockerSettings>,
    /// `CI_DOCKER_STORAGE_SIZE` in bytes.
    pub storage_size: u64,
    /// The path of `SPIFFE_ENDPOINT_SOCKET`, when it is a Unix socket.
    pub agent_endpoint: Option<PathBuf>,
}

/// How the executor was started.
#[derive(Debug)]
pub enum Start {
    /// As root in its Pod or VM: prepare, start dockerd, run the rest as the runner.
    Root(RootConfig),
    /// Run as started.
    AsIs,
}

/// The `dockerd` sidecar's configuration (`CI_EXECUTOR_DOCKERD_ONLY`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonConfig {
    /// The daemon (never an external one: this is the one the others wait for).
    pub docker: DockerSettings,
    /// `CI_DOCKER_STORAGE_SIZE` when this process prepares storage and cgroups (root in
    /// the executor image); `None` runs dockerd as it is (the test kit's stand-in).
    pub prepare: Option<u64>,
}

fn flag(get: &impl Fn(&str) -> Option<String>, name: &'static str) -> Result<bool, JobEnvError> {
    match get(name).as_deref().map(str::trim) {
        None | Some("") => Ok(false),
        Some(v) => match v.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" => Ok(true),
            "false" | "0" | "no" => Ok(false),
            _ => Err(JobEnvError::Env {
                name,
                problem: format!("{v:?} is neither true nor false"),
            }),
        },
    }
}

/// `Some` in the Pod's `dockerd` sidecar (`CI_EXECUTOR_DOCKERD_ONLY`), read before
/// anything of the executor's: that container has no assignment.
pub fn daemon_mode(
    euid_is_root: bool,
    get: impl Fn(&str) -> Option<String>,
) -> Result<Option<DaemonConfig>, JobEnvError> {
    if !flag(&get, DOCKERD_ONLY)? {
        return Ok(None);
    }
    let mut docker = DockerSettings::from_env_or(&get, true)?.ok_or(JobEnvError::Env {
        name: DOCKERD_ONLY,
        problem: "the daemon's container cannot run without its daemon \
                  (CI_RUNNER_START_DOCKER=false)"
            .into(),
    })?;
    docker.external = false;
    let prepare = if euid_is_root && flag(&get, SANDBOXED)? {
        Some(
            match get(DOCKER_STORAGE_SIZE).filter(|v| !v.trim().is_empty()) {
                None => DEFAULT_STORAGE_SIZE,
                Some(text) => parse_size(&text).ok_or_else(|| JobEnvError::Env {
                    name: DOCKER_STORAGE_SIZE,
                    problem: format!("{text:?} is not a size such as 20G"),
                })?,
            },
        )
    } else {
        None
    };
    Ok(Some(DaemonConfig { docker, prepare }))
}

/// The `dockerd` sidecar: prepares (as root in the image), runs dockerd until SIGTERM or
/// SIGINT, then stops it. Moving this container's processes into a child cgroup is
/// harmless: it needs no SVID.
pub async fn run_daemon(
    config: DaemonConfig,
    paths: &Paths,
    signals: &mut tokio::sync::mpsc::Receiver<Forward>,
) -> Result<ExitStatus, JobEnvError> {
    if let Some(storage_size) = config.prepare {
        let root = RootConfig {
            uid: 0,
            gid: 0,
            docker: Some(config.docker.clone()),
            storage_size,
            agent_endpoint: None,
        };
        let facts = gather(&root, paths)?;
        for step in plan(&root, &facts, paths) {
            tracing::info!(?step, "preparing the Docker daemon's container");
            apply(&step)?;
        }
    }
    let mut dockerd = Dockerd::start(&config.docker).await?;
    tokio::select! {
        status = dockerd.exited() => return Ok(status?),
        _ = signals.recv() => {}
    }
    dockerd.stop().await;
    Ok(std::os::unix::process::ExitStatusExt::from_raw(0))
}

/// Whether the process's effective uid is 0.
pub fn running_as_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Decides how the executor runs: as root in its own Pod or VM (`CI_EXECUTOR_SANDBOXED`)
/// it prepares the job's environment; otherwise (any other user, the process backend,
/// the unprivileged executor the root one started) it runs as started.
pub fn start_mode(
    euid_is_root: bool,
    get: impl Fn(&str) -> Option<String>,
) -> Result<Start, JobEnvError> {
    let non_empty = |name: &str| get(name).filter(|v| !v.trim().is_empty());
    let sandboxed = match non_empty(SANDBOXED) {
        None => false,
        Some(v) => match v.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" => true,
            "false" | "0" | "no" => false,
            _ => {
                return Err(JobEnvError::Env {
                    name: SANDBOXED,
                    problem: format!("{v:?} is neither true nor false"),
                });
            }
        },
    };
    if !sandboxed || !euid_is_root || non_empty(RUN_AS).is_some() {
        return Ok(Start::AsIs);
    }
    let uid_text = non_empty(RUNNER_UID).unwrap_or_else(|| "2000".into());
    let id = |name: &'static str, text: &str| -> Result<u32, JobEnvError> {
        match text.trim().parse::<u32>() {
            Ok(0) => Err(JobEnvError::Env {
                name,
                problem: "must not be 0: the job never runs as root".into(),
            }),
            Ok(v) => Ok(v),
            Err(_) => Err(JobEnvError::Env {
                name,
                problem: format!("{text:?} is not a numeric id"),
            }),
        }
    };
    let uid = id(RUNNER_UID, &uid_text)?;
    let gid = match non_empty(RUNNER_GID) {
        Some(text) => id(RUNNER_GID, &text)?,
        None => uid,
    };
    let storage_size = match non_empty(DOCKER_STORAGE_SIZE) {
        None => DEFAULT_STORAGE_SIZE,
        Some(text) => parse_size(&text).ok_or_else(|| JobEnvError::Env {
            name: DOCKER_STORAGE_SIZE,
            problem: format!("{text:?} is not a size such as 20G"),
        })?,
    };
    let agent_endpoint = get(gdr_core::executor::env::SPIFFE_ENDPOINT_SOCKET)
        .and_then(|v| unix_path(&v).map(PathBuf::from));
    Ok(Start::Root(RootConfig {
        uid,
        gid,
        docker: DockerSettings::from_env_or(&get, true)?,
        storage_size,
        agent_endpoint,
    }))
}

/// The path of a `unix:` endpoint (`unix:///p`, `unix:/p`).
fn unix_path(endpoint: &str) -> Option<&str> {
    let rest = endpoint.strip_prefix("unix:")?;
    let path = rest.strip_prefix("//").unwrap_or(rest);
    path.starts_with('/').then_some(path)
}

/// `20G`, `512M`, `1T` or bytes.
fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, shift) = match text.char_indices().last()? {
        (i, 'K' | 'k') => (&text[..i], 10),
        (i, 'M' | 'm') => (&text[..i], 20),
        (i, 'G' | 'g') => (&text[..i], 30),
        (i, 'T' | 't') => (&text[..i], 40),
        _ => (text, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// What the root executor found on the system.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    /// `statfs` type of the Docker data root (`None`: unknown).
    pub docker_data_fs: Option<i64>,
    /// Whether the loop control device exists.
    pub loop_control: bool,
    /// Minors of the loop devices that exist (of 0–7).
    pub loop_nodes: Vec<u32>,
    /// The cgroup v2 root, if `/sys/fs/cgroup` is one.
    pub cgroup: Option<CgroupRoot>,
    /// Whether something is at the agent socket path already.
    pub agent_socket_present: bool,
}

/// The state of a cgroup v2 root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupRoot {
    /// `cgroup.controllers`.
    pub controllers: Vec<String>,
    /// `cgroup.subtree_control`.
    pub subtree_control: Vec<String>,
    /// Whether `cgroup.procs` lists any process.
    pub has_processes: bool,
}

/// One privileged action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// `mknod <path> c|b <major> <minor>`.
    MakeNode {
        /// The node.
        path: PathBuf,
        /// Block (else character) device.
        block: bool,
        /// Major number.
        major: u32,
        /// Minor number.
        minor: u32,
    },
    /// An ext4 file of `size` bytes at `image`, attached to a loop device and mounted on
    /// `target`.
    LoopStorage {
        /// The backing file.
        image: PathBuf,
        /// Its size.
        size: u64,
        /// The mount point.
        target: PathBuf,
    },
    /// Every process of the cgroup `root` moves to its child `child`.
    MoveProcesses {
        /// The root cgroup.
        root: PathBuf,
        /// The child cgroup.
        child: PathBuf,
    },
    /// `root` delegates these controllers to its children.
    Delegate {
        /// The root cgroup.
        root: PathBuf,
        /// Controllers to enable.
        controllers: Vec<String>,
    },
    /// A symbolic link `link` to the agent's socket `target`.
    LinkAgentSocket {
        /// The path jobs use.
        link: PathBuf,
        /// The agent's socket.
        target: PathBuf,
    },
}

/// File systems on which overlayfs cannot keep its upper layer: overlayfs itself, FUSE
/// (virtio-fs, a Kata guest's shared root file system), 9p, NFS, SMB.
const NO_OVERLAY_UPPER: &[i64] = &[
    0x794c_7630, // overlayfs
    0x6573_5546, // FUSE, virtio-fs
    0x0102_1997, // 9p
    0x6969,      // NFS
    0xff53_4d42, // CIFS
    0xfe53_4d42, // SMB2
];

/// Whether Docker's overlay2 storage can live on a file system of this `statfs` type.
pub fn holds_overlay(fs_type: i64) -> bool {
    !NO_OVERLAY_UPPER.contains(&fs_type)
}

/// What the root executor does, in order, for `config` on a system with `facts`.
pub fn plan(config: &RootConfig, facts: &Facts, paths: &Paths) -> Vec<Step> {
    let mut steps = Vec::new();
    // An external daemon (the Pod's `dockerd` container) prepared its own storage and
    // cgroups; moving this container's processes would hide its ID from SPIRE.
    if config.docker.as_ref().is_some_and(|d| !d.external) {
        if facts.docker_data_fs.is_some_and(|fs| !holds_overlay(fs)) {
            if !facts.loop_control {
                steps.push(Step::MakeNode {
                    path: paths.dev.join("loop-control"),
                    block: false,
                    major: 10,
                    minor: 237,
                });
            }
            for minor in (0..LOOP_NODES).filter(|m| !facts.loop_nodes.contains(m)) {
                steps.push(Step::MakeNode {
                    path: paths.dev.join(format!("loop{minor}")),
                    block: true,
                    major: 7,
                    minor,
                });
            }
            steps.push(Step::LoopStorage {
                image: paths.docker_image.clone(),
                size: config.storage_size,
                target: paths.docker_data.clone(),
            });
        }
        if let Some(root) = &facts.cgroup {
            let missing: Vec<String> = root
                .controllers
                .iter()
                .filter(|c| !root.subtree_control.contains(c))
                .cloned()
                .collect();
            if !missing.is_empty() {
                // "No internal processes": a cgroup with members cannot enable
                // controllers for its children, so its members leave first.
                if root.has_processes {
                    steps.push(Step::MoveProcesses {
                        root: paths.cgroup.clone(),
                        child: paths.cgroup.join(INIT_CGROUP),
                    });
                }
                steps.push(Step::Delegate {
                    root: paths.cgroup.clone(),
                    controllers: missing,
                });
            }
        }
    }
    if let Some(target) = &config.agent_endpoint
        && target != &paths.agent_socket
        && !facts.agent_socket_present
    {
        steps.push(Step::LinkAgentSocket {
            link: paths.agent_socket.clone(),
            target: target.clone(),
        });
    }
    steps
}

fn words(text: &str) -> Vec<String> {
    text.split_whitespace().map(str::to_owned).collect()
}

/// Reads the [`Facts`] at `paths` (creating the Docker data root, whose file system is
/// what counts).
pub fn gather(config: &RootConfig, paths: &Paths) -> Result<Facts, JobEnvError> {
    let docker_data_fs = if config.docker.as_ref().is_some_and(|d| !d.external) {
        std::fs::create_dir_all(&paths.docker_data).map_err(step_error(format!(
            "creating {}",
            paths.docker_data.display()
        )))?;
        rustix::fs::statfs(&paths.docker_data)
            .ok()
            .map(|s| s.f_type)
    } else {
        None
    };
    let cgroup = match std::fs::read_to_string(paths.cgroup.join("cgroup.controllers")) {
        Ok(controllers) => Some(CgroupRoot {
            controllers: words(&controllers),
            subtree_control: std::fs::read_to_string(paths.cgroup.join("cgroup.subtree_control"))
                .map(|t| words(&t))
                .unwrap_or_default(),
            has_processes: std::fs::read_to_string(paths.cgroup.join("cgroup.procs"))
                .is_ok_and(|t| !t.trim().is_empty()),
        }),
        Err(_) => None,
    };
    Ok(Facts {
        docker_data_fs,
        loop_control: paths.dev.join("loop-control").exists(),
        loop_nodes: (0..LOOP_NODES)
            .filter(|m| paths.dev.join(format!("loop{m}")).exists())
            .collect(),
        cgroup,
        agent_socket_present: std::fs::symlink_metadata(&paths.agent_socket).is_ok(),
    })
}

/// Runs one step.
pub fn apply(step: &Step) -> Result<(), JobEnvError> {
    match step {
        Step::MakeNode {
            path,
            block,
            major,
            minor,
        } => {
            let kind = if *block {
                rustix::fs::FileType::BlockDevice
            } else {
                rustix::fs::FileType::CharacterDevice
            };
            rustix::fs::mknodat(
                rustix::fs::CWD,
                path,
                kind,
                rustix::fs::Mode::from_raw_mode(0o660),
                rustix::fs::makedev(*major, *minor),
            )
            .map_err(|e| std::io::Error::from_raw_os_error(e.raw_os_error()))
            .map_err(step_error(format!(
                "creating the device node {}",
                path.display()
            )))
        }
        Step::LoopStorage {
            image,
            size,
            target,
        } => loop_storage(image, *size, target),
        Step::MoveProcesses { root, child } => move_processes(root, child),
        Step::Delegate { root, controllers } => {
            let line: Vec<String> = controllers.iter().map(|c| format!("+{c}")).collect();
            let file = root.join("cgroup.subtree_control");
            std::fs::write(&file, line.join(" "))
                .map_err(step_error(format!("writing {}", file.display())))
        }
        Step::LinkAgentSocket { link, target } => {
            if let Some(parent) = link.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(step_error(format!("creating {}", parent.display())))?;
            }
            std::os::unix::fs::symlink(target, link).map_err(step_error(format!(
                "linking {} to {}",
                link.display(),
                target.display()
            )))
        }
    }
}

/// Moves every process listed in `root/cgroup.procs` into `child` (created). A process
/// that exited meanwhile, or that cannot move (a kernel thread), is skipped, as the
/// `docker:dind` entrypoint skips it.
fn move_processes(root: &Path, child: &Path) -> Result<(), JobEnvError> {
    std::fs::create_dir_all(child).map_err(step_error(format!("creating {}", child.display())))?;
    let procs = root.join("cgroup.procs");
    let members = std::fs::read_to_string(&procs)
        .map_err(step_error(format!("reading {}", procs.display())))?;
    let target = child.join("cgroup.procs");
    for pid in members.split_whitespace() {
        if let Err(e) = std::fs::write(&target, pid) {
            tracing::debug!(pid, error = %e, "a process did not move to the child cgroup");
        }
    }
    Ok(())
}

/// The commands that put an ext4 file system on `image` and mount it, through a loop
/// device, on `target` (`{device}` stands for the device `losetup` prints).
pub fn loop_commands(image: &Path, target: &Path) -> [Vec<String>; 3] {
    let image = image.display().to_string();
    [
        vec!["mkfs.ext4".into(), "-F".into(), "-q".into(), image.clone()],
        vec!["losetup".into(), "--find".into(), "--show".into(), image],
        vec![
            "mount".into(),
            "{device}".into(),
            target.display().to_string(),
        ],
    ]
}

fn loop_storage(image: &Path, size: u64, target: &Path) -> Result<(), JobEnvError> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(image)
        .map_err(step_error(format!("creating {}", image.display())))?;
    file.set_len(size)
        .map_err(step_error(format!("sizing {}", image.display())))?;
    drop(file);
    let mut device = String::new();
    for command in loop_commands(image, target) {
        let argv: Vec<String> = command
            .iter()
            .map(|a| a.replace("{device}", &device))
            .collect();
        let line = argv.join(" ");
        let output = std::process::Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(step_error(format!("running {line}")))?;
        if !output.status.success() {
            return Err(JobEnvError::Program {
                command: line,
                status: format!(
                    "{}: {}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr).trim()
                ),
            });
        }
        if argv[0] == "losetup" {
            device = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        }
    }
    tracing::info!(image = %image.display(), device, target = %target.display(), "Docker storage on a loop device");
    Ok(())
}

/// The unprivileged executor's first act: take the identity [`RUN_AS`] names, if it is
/// set. Must run while the process has one thread (before any runtime starts): the
/// system calls change the calling thread's credentials only.
pub fn take_identity(get: impl Fn(&str) -> Option<String>) -> Result<Option<RunAs>, JobEnvError> {
    let Some(text) = get(RUN_AS).filter(|v| !v.trim().is_empty()) else {
        return Ok(None);
    };
    let run_as = RunAs::parse(&text).ok_or_else(|| JobEnvError::Env {
        name: RUN_AS,
        problem: format!("{text:?} is not <uid>:<gid>:<groups>"),
    })?;
    let fail = |source: std::io::Error| JobEnvError::Drop {
        uid: run_as.uid,
        gid: run_as.gid,
        groups: run_as.groups.clone(),
        source,
    };
    let threads = std::fs::read_to_string("/proc/self/status")
        .map_err(fail)?
        .lines()
        .find_map(|l| l.strip_prefix("Threads:").map(|v| v.trim().to_owned()));
    if threads.as_deref() != Some("1") {
        return Err(fail(std::io::Error::other(format!(
            "the process has {} threads; credentials must change while it has one",
            threads.unwrap_or_default()
        ))));
    }
    let io = |e: rustix::io::Errno| std::io::Error::from_raw_os_error(e.raw_os_error());
    let groups: Vec<rustix::process::Gid> = run_as
        .groups
        .iter()
        .map(|g| rustix::process::Gid::from_raw(*g))
        .collect();
    let gid = rustix::process::Gid::from_raw(run_as.gid);
    let uid = rustix::process::Uid::from_raw(run_as.uid);
    // Groups and gid first: once the uid is dropped, they can no longer change.
    rustix::thread::set_thread_groups(&groups)
        .map_err(io)
        .map_err(fail)?;
    rustix::thread::set_thread_res_gid(gid, gid, gid)
        .map_err(io)
        .map_err(fail)?;
    rustix::thread::set_thread_res_uid(uid, uid, uid)
        .map_err(io)
        .map_err(fail)?;
    if rustix::process::getuid() != uid
        || rustix::process::geteuid() != uid
        || rustix::process::getgid() != gid
    {
        return Err(fail(std::io::Error::other("the identity did not change")));
    }
    Ok(Some(run_as))
}

/// The root executor: prepares the job's environment, starts dockerd, runs the
/// unprivileged executor (`program executor`) as the runner and returns its status,
/// stopping dockerd after it.
pub async fn run_as_root(
    config: RootConfig,
    program: &Path,
    mut signals: tokio::sync::mpsc::Receiver<Forward>,
) -> Result<ExitStatus, JobEnvError> {
    run_as_root_at(config, program, &Paths::system(), &mut signals).await
}

/// [`run_as_root`] on the system at `paths`.
pub async fn run_as_root_at(
    config: RootConfig,
    program: &Path,
    paths: &Paths,
    signals: &mut tokio::sync::mpsc::Receiver<Forward>,
) -> Result<ExitStatus, JobEnvError> {
    let facts = gather(&config, paths)?;
    let steps = plan(&config, &facts, paths);
    for step in &steps {
        tracing::info!(?step, "preparing the job's environment");
        apply(step)?;
    }
    let docker_group = std::fs::read_to_string(&paths.group_file)
        .ok()
        .and_then(|text| group_gid(&text, DOCKER_GROUP));
    let run_as = RunAs {
        uid: config.uid,
        gid: config.gid,
        groups: docker_group
            .into_iter()
            .filter(|g| *g != config.gid)
            .collect(),
    };
    let dockerd = match &config.docker {
        Some(settings) => Some(Dockerd::start(settings).await?),
        None => None,
    };
    let mut command = tokio::process::Command::new(program);
    command
        .arg("executor")
        .env(RUN_AS, run_as.encode())
        // The daemon is this executor's; the unprivileged one only points the runner at it.
        .env(crate::docker::START_DOCKER, "false")
        .kill_on_drop(true);
    if let Some(d) = &dockerd {
        command.env("DOCKER_HOST", d.docker_host());
    }
    let agent_reachable = steps
        .iter()
        .any(|s| matches!(s, Step::LinkAgentSocket { .. }))
        || config.agent_endpoint.as_deref() == Some(paths.agent_socket.as_path());
    if agent_reachable {
        command.env(
            gdr_core::executor::env::SPIFFE_ENDPOINT_SOCKET,
            format!("unix://{}", paths.agent_socket.display()),
        );
    }
    tracing::info!(uid = run_as.uid, gid = run_as.gid, groups = ?run_as.groups, "starting the executor as the runner's user");
    let child = command.spawn().map_err(JobEnvError::Child);
    let status = match child {
        Ok(mut child) => wait_forwarding(&mut child, signals).await,
        Err(e) => Err(e),
    };
    if let Some(d) = dockerd {
        d.stop().await;
    }
    status
}

async fn wait_forwarding(
    child: &mut tokio::process::Child,
    signals: &mut tokio::sync::mpsc::Receiver<Forward>,
) -> Result<ExitStatus, JobEnvError> {
    loop {
        let forward = tokio::select! {
            status = child.wait() => return status.map_err(JobEnvError::Child),
            Some(forward) = signals.recv() => forward,
        };
        let signal = match forward {
            Forward::Terminate => Signal::TERM,
            Forward::Interrupt => Signal::INT,
        };
        if let Some(pid) = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .and_then(Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, signal);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn docker() -> Option<DockerSettings> {
        Some(DockerSettings {
            program: "dockerd".into(),
            socket: "/var/run/docker.sock".into(),
            ready_timeout: Duration::from_secs(60),
            external: false,
        })
    }

    fn config() -> RootConfig {
        RootConfig {
            uid: 2000,
            gid: 2000,
            docker: docker(),
            storage_size: DEFAULT_STORAGE_SIZE,
            agent_endpoint: Some(AGENT_SOCKET.into()),
        }
    }

    const EXT4: i64 = 0xef53;
    const VIRTIOFS: i64 = 0x6573_5546;

    /// A Pod on a node: ext4 under the emptyDir, loop devices, a delegating cgroup root.
    fn pod_facts() -> Facts {
        Facts {
            docker_data_fs: Some(EXT4),
            loop_control: true,
            loop_nodes: (0..8).collect(),
            cgroup: Some(CgroupRoot {
                controllers: words("cpu memory pids"),
                subtree_control: words("cpu memory pids"),
                has_processes: false,
            }),
            agent_socket_present: true,
        }
    }

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    /// DESIGN invariant 16: only a root executor of the executor image (sandboxed)
    /// prepares the job's environment (with Docker by default); any other start runs as
    /// it is.
    #[test]
    fn only_a_sandboxed_root_executor_prepares_the_environment_and_docker_is_on_by_default() {
        let vars = [(SANDBOXED, "true")];
        let Start::Root(root) = start_mode(true, env(&vars)).unwrap() else {
            panic!("a sandboxed root executor")
        };
        assert_eq!((root.uid, root.gid), (2000, 2000));
        assert!(root.docker.is_some(), "Docker is on by default");
        let uid = [(SANDBOXED, "true"), (RUNNER_UID, "3000")];
        let Start::Root(root) = start_mode(true, env(&uid)).unwrap() else {
            panic!("root")
        };
        assert_eq!((root.uid, root.gid), (3000, 3000));
        let off = [(SANDBOXED, "true"), ("CI_RUNNER_START_DOCKER", "false")];
        let Start::Root(root) = start_mode(true, env(&off)).unwrap() else {
            panic!("root")
        };
        assert_eq!(root.docker, None);
        let as_is = |vars: &[(&str, &str)], root: bool| {
            matches!(start_mode(root, env(vars)).unwrap(), Start::AsIs)
        };
        assert!(as_is(&vars, false), "not root");
        // A root executor on a host (a backend's variables, no image's): as it is.
        assert!(as_is(&[(RUNNER_UID, "2000")], true));
        assert!(as_is(
            &[(SANDBOXED, "true"), (RUN_AS, "2000:2000:2001")],
            true
        ));
        let e = start_mode(true, env(&[(SANDBOXED, "true"), (RUNNER_UID, "0")])).unwrap_err();
        assert!(e.to_string().starts_with("CI_RUNNER_UID:"), "{e}");
    }

    /// DESIGN invariant 16: a Pod whose storage holds overlay and whose cgroup root
    /// delegates needs nothing but dockerd.
    #[test]
    fn a_pod_with_overlay_capable_storage_and_a_delegating_cgroup_needs_no_step() {
        assert_eq!(plan(&config(), &pod_facts(), &Paths::system()), vec![]);
    }

    /// DESIGN invariant 16: a Kata guest whose Docker root is on virtio-fs and which has
    /// no loop device nodes gets them, then loop-backed storage.
    #[test]
    fn a_guest_without_loop_nodes_gets_them_and_loop_backed_docker_storage() {
        let facts = Facts {
            docker_data_fs: Some(VIRTIOFS),
            loop_control: false,
            loop_nodes: vec![0, 1],
            ..pod_facts()
        };
        let steps = plan(&config(), &facts, &Paths::system());
        let mut expected = vec![Step::MakeNode {
            path: "/dev/loop-control".into(),
            block: false,
            major: 10,
            minor: 237,
        }];
        expected.extend((2..8).map(|minor| Step::MakeNode {
            path: format!("/dev/loop{minor}").into(),
            block: true,
            major: 7,
            minor,
        }));
        expected.push(Step::LoopStorage {
            image: "/var/lib/docker.img".into(),
            size: 20 << 30,
            target: "/var/lib/docker".into(),
        });
        assert_eq!(steps, expected);
        assert!(holds_overlay(EXT4) && !holds_overlay(VIRTIOFS));
    }

    /// DESIGN invariant 16: a cgroup v2 root with member processes cannot delegate; its
    /// processes move to a child first, then the missing controllers are delegated.
    #[test]
    fn a_root_cgroup_with_processes_moves_them_to_a_child_before_delegating() {
        let facts = Facts {
            cgroup: Some(CgroupRoot {
                controllers: words("cpuset cpu io memory pids"),
                subtree_control: words("cpu"),
                has_processes: true,
            }),
            ..pod_facts()
        };
        assert_eq!(
            plan(&config(), &facts, &Paths::system()),
            vec![
                Step::MoveProcesses {
                    root: "/sys/fs/cgroup".into(),
                    child: "/sys/fs/cgroup/init".into(),
                },
                Step::Delegate {
                    root: "/sys/fs/cgroup".into(),
                    controllers: words("cpuset io memory pids"),
                },
            ]
        );
        // An empty root delegates without moving anything; cgroup v1 needs nothing.
        let empty = Facts {
            cgroup: Some(CgroupRoot {
                has_processes: false,
                ..facts.cgroup.clone().unwrap()
            }),
            ..facts.clone()
        };
        assert!(matches!(
            plan(&config(), &empty, &Paths::system()).as_slice(),
            [Step::Delegate { .. }]
        ));
        let v1 = Facts {
            cgroup: None,
            ..facts
        };
        assert_eq!(plan(&config(), &v1, &Paths::system()), vec![]);
    }

    /// The container ID SPIRE's `k8s` workload attestor reads from a caller's cgroup
    /// path, as its documentation and code describe the format (docs/pod-backend.md):
    /// a trailing `.scope` is dropped, a `pod<UID>` segment must come first, and the ID is
    /// the last run of characters that are not ASCII punctuation.
    fn attested_container_id(path: &str) -> Option<&str> {
        let path = path.strip_suffix(".scope").unwrap_or(path);
        // `pod`, after punctuation, then a UID (8-4-4-4-12 hex digits, any punctuation
        // between the groups) and punctuation.
        let uid_then_punct = |rest: &str| {
            rest.len() > 36
                && rest.bytes().take(37).enumerate().all(|(i, b)| match i {
                    8 | 13 | 18 | 23 | 36 => b.is_ascii_punctuation(),
                    _ => b.is_ascii_hexdigit(),
                })
        };
        let after_pod = path
            .match_indices("pod")
            .filter(|(i, _)| path[..*i].ends_with(|c: char| c.is_ascii_punctuation()))
            .map(|(i, _)| &path[i + 3..])
            .find(|rest| uid_then_punct(rest))?;
        let start = after_pod
            .rfind(|c: char| c.is_ascii_punctuation())
            .map_or(0, |i| i + 1);
        let id = &after_pod[start..];
        (!id.is_empty()).then_some(id)
    }

    /// DESIGN invariant 16, issue 37 item 3: the executor and the job's processes stay in
    /// a cgroup whose path SPIRE's `k8s` workload attestor reads as their container's ID,
    /// or they get no SVID on a real node. A privileged Pod's executor uses the Pod's
    /// `dockerd` container (`CI_DOCKER_EXTERNAL`, as the Pod backend sets it), so even on
    /// a cgroup root that does not delegate and has members it moves no process into a
    /// child cgroup (such as `<container>.scope/init`, which the attestor reads as
    /// `init`).
    #[test]
    fn the_executors_cgroup_still_names_its_container_for_spires_k8s_attestor() {
        const CONTAINER: &str = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod2c48913c_b29f_11e7_9350_020968147796.slice/cri-containerd-b2a102854b4969b2ce98dc329c86b4fb2b06e4ad2cc8da9d8a7578c9cd2004a2.scope";
        const ID: &str = "b2a102854b4969b2ce98dc329c86b4fb2b06e4ad2cc8da9d8a7578c9cd2004a2";
        assert_eq!(
            attested_container_id(CONTAINER),
            Some(ID),
            "the format as read"
        );
        assert_eq!(
            attested_container_id(&format!("{CONTAINER}/init")),
            Some("init")
        );
        let pod_env = [
            (SANDBOXED, "true"),
            (RUNNER_UID, "2000"),
            ("CI_RUNNER_START_DOCKER", "true"),
            ("CI_DOCKER_EXTERNAL", "true"),
            ("CI_DOCKER_SOCKET", "/run/docker-socket/docker.sock"),
        ];
        let Start::Root(config) = start_mode(true, env(&pod_env)).unwrap() else {
            panic!("the Pod's executor starts as root")
        };
        let facts = Facts {
            docker_data_fs: Some(VIRTIOFS),
            loop_control: false,
            loop_nodes: vec![],
            cgroup: Some(CgroupRoot {
                controllers: words("cpuset cpu io memory pids"),
                subtree_control: words("cpu"),
                has_processes: true,
            }),
            agent_socket_present: true,
        };
        let steps = plan(&config, &facts, &Paths::system());
        let executor = steps
            .iter()
            .find_map(|step| match step {
                Step::MoveProcesses { root, child } => child
                    .strip_prefix(root)
                    .ok()
                    .map(|rest| format!("{CONTAINER}/{}", rest.display())),
                _ => None,
            })
            .unwrap_or_else(|| CONTAINER.to_owned());
        assert_eq!(attested_container_id(&executor), Some(ID), "{executor}");
        // Nothing of the daemon's is the executor's to prepare: it is the other container's.
        assert_eq!(steps, vec![], "{steps:?}");
    }

    /// DESIGN invariant 16: the Pod's `dockerd` container runs the daemon itself (never
    /// waits for an external one) and prepares storage and cgroups only as root in the
    /// executor image; anything else is no daemon container.
    #[test]
    fn the_dockerd_container_runs_its_own_daemon_and_prepares_only_as_root_in_the_image() {
        let vars = [
            (DOCKERD_ONLY, "true"),
            (SANDBOXED, "true"),
            ("CI_DOCKER_EXTERNAL", "true"),
            ("CI_DOCKER_SOCKET", "/run/docker-socket/docker.sock"),
        ];
        let daemon = daemon_mode(true, env(&vars)).unwrap().unwrap();
        assert!(!daemon.docker.external);
        assert_eq!(
            daemon.docker.socket,
            PathBuf::from("/run/docker-socket/docker.sock")
        );
        assert_eq!(daemon.prepare, Some(DEFAULT_STORAGE_SIZE));
        let stand_in = daemon_mode(false, env(&vars)).unwrap().unwrap();
        assert_eq!(stand_in.prepare, None, "not root: runs dockerd as it is");
        // Root outside the executor image (a test run as root, whose fake kubelet runs
        // the sidecar on the host): the host's cgroups and devices are never touched.
        let host = daemon_mode(true, env(&vars[..1])).unwrap().unwrap();
        assert_eq!(host.prepare, None, "root without CI_EXECUTOR_SANDBOXED");
        assert_eq!(
            daemon_mode(true, env(&[(SANDBOXED, "true")])).unwrap(),
            None
        );
        let e = daemon_mode(true, env(&[(DOCKERD_ONLY, "perhaps")])).unwrap_err();
        assert!(
            e.to_string().starts_with("CI_EXECUTOR_DOCKERD_ONLY:"),
            "{e}"
        );
    }

    /// DESIGN invariant 16: without Docker nothing of Docker's is prepared.
    #[test]
    fn without_docker_neither_storage_nor_cgroups_are_touched() {
        let facts = Facts {
            docker_data_fs: Some(VIRTIOFS),
            loop_control: false,
            loop_nodes: vec![],
            cgroup: Some(CgroupRoot {
                controllers: words("cpu"),
                subtree_control: vec![],
                has_processes: true,
            }),
            agent_socket_present: true,
        };
        let config = RootConfig {
            docker: None,
            ..config()
        };
        assert_eq!(plan(&config, &facts, &Paths::system()), vec![]);
    }

    /// DESIGN invariant 13: an agent socket elsewhere is linked where jobs look for it,
    /// unless something is there already.
    #[test]
    fn an_agent_socket_elsewhere_is_linked_at_the_path_jobs_use() {
        let config = RootConfig {
            agent_endpoint: Some("/run/agent/api.sock".into()),
            ..config()
        };
        let facts = Facts {
            agent_socket_present: false,
            ..pod_facts()
        };
        assert_eq!(
            plan(&config, &facts, &Paths::system()),
            vec![Step::LinkAgentSocket {
                link: AGENT_SOCKET.into(),
                target: "/run/agent/api.sock".into(),
            }]
        );
        let present = Facts {
            agent_socket_present: true,
            ..facts
        };
        assert_eq!(plan(&config, &present, &Paths::system()), vec![]);
    }

    #[test]
    fn identities_and_sizes_parse() {
        let run_as = RunAs {
            uid: 2000,
            gid: 2000,
            groups: vec![2001],
        };
        assert_eq!(RunAs::parse(&run_as.encode()), Some(run_as));
        assert_eq!(
            RunAs::parse("2000:2000:"),
            Some(RunAs {
                uid: 2000,
                gid: 2000,
                groups: vec![]
            })
        );
        assert_eq!(RunAs::parse("x:1:"), None);
        let groups = "root:x:0:\nrunner:x:2000:\ndocker:x:2001:runner\n";
        assert_eq!(group_gid(groups, "docker"), Some(2001));
        assert_eq!(group_gid(groups, "wheel"), None);
        assert_eq!(parse_size("20G"), Some(20 << 30));
        assert_eq!(parse_size("512m"), Some(512 << 20));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("lots"), None);
        assert_eq!(unix_path("unix:///run/a.sock"), Some("/run/a.sock"));
        assert_eq!(unix_path("unix:/tmp/b.sock"), Some("/tmp/b.sock"));
        assert_eq!(unix_path("tcp://127.0.0.1:1"), None);
    }

    /// The thin steps, on temporary directories standing in for `/dev`, the cgroup root
    /// and `/run` (device nodes only where the test runs as root).
    #[test]
    fn the_steps_create_nodes_move_processes_delegate_and_link() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("cgroup");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("cgroup.procs"), "1\n17\n").unwrap();
        apply(&Step::MoveProcesses {
            root: root.clone(),
            child: root.join("init"),
        })
        .unwrap();
        // A plain file keeps the last write; cgroupfs would take each pid in turn.
        assert_eq!(
            std::fs::read_to_string(root.join("init/cgroup.procs")).unwrap(),
            "17"
        );
        apply(&Step::Delegate {
            root: root.clone(),
            controllers: words("cpu memory"),
        })
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(root.join("cgroup.subtree_control")).unwrap(),
            "+cpu +memory"
        );
        let target = dir.path().join("agent.sock");
        let link = dir.path().join("run/spire/agent-sockets/spire-agent.sock");
        apply(&Step::LinkAgentSocket {
            link: link.clone(),
            target: target.clone(),
        })
        .unwrap();
        assert_eq!(std::fs::read_link(&link).unwrap(), target);

        if rustix::process::geteuid().is_root() {
            use std::os::unix::fs::{FileTypeExt, MetadataExt};
            let node = dir.path().join("loop3");
            apply(&Step::MakeNode {
                path: node.clone(),
                block: true,
                major: 7,
                minor: 3,
            })
            .unwrap();
            let meta = std::fs::metadata(&node).unwrap();
            assert!(meta.file_type().is_block_device());
            assert_eq!(meta.rdev(), rustix::fs::makedev(7, 3));
        } else {
            eprintln!("not root: device node creation is not exercised");
        }
    }

    #[test]
    fn gathering_reads_the_cgroup_root_and_the_loop_nodes() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths {
            dev: dir.path().join("dev"),
            cgroup: dir.path().join("cgroup"),
            docker_data: dir.path().join("docker"),
            docker_image: dir.path().join("docker.img"),
            agent_socket: dir.path().join("agent.sock"),
            group_file: dir.path().join("group"),
        };
        std::fs::create_dir_all(&paths.dev).unwrap();
        std::fs::write(paths.dev.join("loop0"), "").unwrap();
        std::fs::create_dir_all(&paths.cgroup).unwrap();
        std::fs::write(paths.cgroup.join("cgroup.controllers"), "cpu memory\n").unwrap();
        std::fs::write(paths.cgroup.join("cgroup.subtree_control"), "").unwrap();
        std::fs::write(paths.cgroup.join("cgroup.procs"), "1\n").unwrap();
        let facts = gather(&config(), &paths).unwrap();
        assert!(paths.docker_data.is_dir(), "the data root is created");
        assert!(facts.docker_data_fs.is_some());
        assert_eq!(facts.loop_nodes, vec![0]);
        assert!(!facts.loop_control && !facts.agent_socket_present);
        assert_eq!(
            facts.cgroup,
            Some(CgroupRoot {
                controllers: words("cpu memory"),
                subtree_control: vec![],
                has_processes: true,
            })
        );
    }

    #[test]
    fn the_loop_commands_format_mount_and_attach_the_image() {
        let [mkfs, losetup, mount] = loop_commands(
            Path::new("/var/lib/docker.img"),
            Path::new("/var/lib/docker"),
        );
        assert_eq!(mkfs, ["mkfs.ext4", "-F", "-q", "/var/lib/docker.img"]);
        assert_eq!(
            losetup,
            ["losetup", "--find", "--show", "/var/lib/docker.img"]
        );
        assert_eq!(mount, ["mount", "{device}", "/var/lib/docker"]);
    }
}
