//! The burst as users see it, with the real programs: the real Gitea and the unmodified
//! official runner, built from their Go modules by `tests/peers/build.sh` (`GITEA_BIN`,
//! `GITEA_RUNNER_BIN`, `GITEA_STATIC_ROOT`, as `.ci/run` exports them). On one side K plain
//! official runners registered with that Gitea, each a loop of fresh `daemon --once`
//! processes (one job per process, like the runner in each executor); on the other the
//! controller binary at `pod_capacity = K`, started as an operator starts it, running that
//! same runner in a fresh executor per job. Two workloads: a job of one `run: true` step
//! (the runner's own cost), and a job of `sleep 5` (a short real job). The makespan runs
//! from the `git push` that queues the jobs to the moment Gitea's API shows every one of
//! them completed, polled every 50 ms on both sides.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use gdr_testkit::controller::{listener, spawn_activated, terminate};
use gdr_testkit::nats_server::NatsServer;
use gdr_testkit::real_gitea::{GiteaOptions, Peers, RealGitea};

use crate::chain::workflow;
use crate::table::{Table, secs};

const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
/// Capacity on our side, plain runners on the other.
const K: usize = 3;
/// (name, jobs, step): the runner's own cost, then a short real job.
const WORKLOADS: [(&str, usize, &str); 2] = [("true", 12, "true"), ("sleep", 6, "sleep 5")];
const WAIT: Duration = Duration::from_secs(600);
const POLL: Duration = Duration::from_millis(50);

pub async fn run(table: &mut Table) {
    if std::env::var_os("GITEA_BIN").is_none() {
        // The part needs the real peers; without them it says so in the table rather
        // than failing the other parts.
        table.row(
            "official runner bursts",
            "not measured".into(),
            "GITEA_BIN, GITEA_RUNNER_BIN, GITEA_STATIC_ROOT unset (tests/peers/build.sh)".into(),
            "–".into(),
            "≤ 1.1×",
        );
        return;
    }
    let peers = Peers::from_env();
    let gitea = RealGitea::start(&peers, GiteaOptions::default()).await;
    let dir = tempfile::tempdir().expect("dir");
    let plain = register_plain_runners(&gitea, &peers, dir.path()).await;
    for (name, jobs, step) in WORKLOADS {
        eprintln!("official runner, {jobs} jobs of `{step}`: {K} plain runners");
        let runners = PlainRunners::start(&peers, &plain);
        let reference = burst(&gitea, &format!("plain-{name}"), jobs, step).await;
        runners.stop().await;
        eprintln!("official runner, {jobs} jobs of `{step}`: this controller");
        let controller = Controller::start(&gitea, &peers, &dir.path().join(name)).await;
        let ours = burst(&gitea, &format!("ours-{name}"), jobs, step).await;
        controller.stop().await;
        table.ratio(
            &format!(
                "official runner, real Gitea: {jobs} jobs of `{step}` queued at once, capacity {K}: makespan from the push"
            ),
            (ours.from_push.as_secs_f64(), secs(ours.from_push)),
            (
                reference.from_push.as_secs_f64(),
                format!(
                    "{} on {K} plain official runners (`daemon --once` per job)",
                    secs(reference.from_push)
                ),
            ),
            "≤ 1.1×",
        );
        table.ratio(
            "  the same, from the first job running (without the idle pickup)",
            (
                ours.from_first_start.as_secs_f64(),
                secs(ours.from_first_start),
            ),
            (
                reference.from_first_start.as_secs_f64(),
                secs(reference.from_first_start),
            ),
            "–",
        );
    }
}

/// What one side took: from the push, and from the first job Gitea showed running (the
/// idle pickup left out: one FetchTask every 2 s for the controller, one per runner for
/// the plain side) to the last job completed.
#[derive(Clone, Copy)]
struct Makespan {
    from_push: Duration,
    from_first_start: Duration,
}

/// Pushes `jobs` jobs of `step` to a new repository and waits until Gitea shows each of
/// them completed successfully.
async fn burst(gitea: &RealGitea, repo: &str, jobs: usize, step: &str) -> Makespan {
    gitea.create_repo(repo).await;
    let start = Instant::now();
    gitea
        .push_workflows(repo, &[("burst.yaml", &workflow(jobs, step))])
        .await;
    let mut first_start = None;
    loop {
        let seen = gitea.jobs(repo).await;
        if first_start.is_none()
            && seen
                .iter()
                .any(|j| j.status != "waiting" && j.status != "queued")
        {
            first_start = Some(Instant::now());
        }
        if seen.len() == jobs && seen.iter().all(|j| j.is_completed()) {
            let end = Instant::now();
            assert!(
                seen.iter().all(|j| j.conclusion == "success"),
                "{repo}: not every job succeeded: {seen:#?}"
            );
            return Makespan {
                from_push: end - start,
                from_first_start: end - first_start.unwrap_or(start),
            };
        }
        assert!(
            start.elapsed() < WAIT,
            "{repo}: the jobs did not complete within {WAIT:?}: {seen:#?}\ngitea log:\n{}",
            gitea.log()
        );
        tokio::time::sleep(POLL).await;
    }
}

// === plain official runners ===

/// Registers K runners with Gitea (`register --no-interactive`), each in its own
/// directory (its `.runner` file and, as `HOME`, the host mode's work directory).
async fn register_plain_runners(gitea: &RealGitea, peers: &Peers, dir: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for i in 0..K {
        let work = dir.join(format!("plain-{i}"));
        std::fs::create_dir_all(&work).expect("runner dir");
        let out = tokio::process::Command::new(&peers.runner)
            .args(["register", "--no-interactive", "--instance"])
            .arg(gitea.url.as_str())
            .args(["--token", &gitea.registration_token])
            .args(["--name", &format!("plain-{i}")])
            .args(["--labels", "self-hosted:host,pod:host"])
            .current_dir(&work)
            .env("HOME", &work)
            .output()
            .await
            .expect("gitea-runner register");
        assert!(
            out.status.success(),
            "gitea-runner register: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        dirs.push(work);
    }
    dirs
}

/// The registered runners, each a loop of fresh `daemon --once` processes.
struct PlainRunners {
    stop: tokio::sync::watch::Sender<bool>,
    loops: tokio::task::JoinSet<()>,
}

impl PlainRunners {
    fn start(peers: &Peers, dirs: &[PathBuf]) -> Self {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut loops = tokio::task::JoinSet::new();
        for work in dirs {
            let (runner, work, mut stopped) = (peers.runner.clone(), work.clone(), stopped.clone());
            loops.spawn(async move {
                while !*stopped.borrow() {
                    let mut child = tokio::process::Command::new(&runner)
                        .args(["daemon", "--once"])
                        .current_dir(&work)
                        .env("HOME", &work)
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .kill_on_drop(true)
                        .spawn()
                        .expect("gitea-runner daemon --once");
                    tokio::select! {
                        _ = child.wait() => {}
                        _ = stopped.changed() => {
                            let _ = child.kill().await;
                        }
                    }
                }
            });
        }
        PlainRunners { stop, loops }
    }

    /// Kills each waiting runner (every job is done by then) and ends the loops.
    async fn stop(mut self) {
        let _ = self.stop.send(true);
        while self.loops.join_next().await.is_some() {}
    }
}

// === the controller, as an operator starts it ===

struct Controller {
    child: tokio::process::Child,
    _listeners: (std::net::TcpListener, std::net::TcpListener),
}

impl Controller {
    /// `controller --gitea-url … --registration-token-file …` with the official runner
    /// and nats-server on `PATH`, `POD_CAPACITY = K`, a fresh state directory under `dir`;
    /// returns once its readiness endpoint answers.
    async fn start(gitea: &RealGitea, peers: &Peers, dir: &Path) -> Self {
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).expect("bin dir");
        std::os::unix::fs::symlink(&peers.runner, bin.join("gitea-runner")).expect("symlink");
        std::os::unix::fs::symlink(NatsServer::binary(), bin.join("nats-server")).expect("symlink");
        let token = dir.join("registration-token");
        std::fs::write(&token, &gitea.registration_token).expect("token");
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).expect("mode");
        let (facade, health) = (listener(), listener());
        let path = format!("{}:/usr/local/bin:/usr/bin:/bin", bin.display());
        let state = dir.join("state").display().to_string();
        let home = dir.display().to_string();
        let capacity = K.to_string();
        let log = dir.join("controller.log");
        // As in the chain part: another build of the executor, if named.
        let program = std::env::var("PERF_EXECUTOR_PROGRAM").unwrap_or_default();
        let mut env = vec![
            ("PATH", path.as_str()),
            ("STATE_DIRECTORY", state.as_str()),
            ("HOME", home.as_str()),
            ("POD_CAPACITY", capacity.as_str()),
        ];
        if !program.is_empty() {
            env.push(("EXECUTOR_PROGRAM", program.as_str()));
        }
        let mut child = spawn_activated(
            BIN.as_ref(),
            &[
                "controller",
                "--gitea-url",
                gitea.url.as_str(),
                "--registration-token-file",
                &token.display().to_string(),
            ],
            &[("facade", &facade), ("health", &health)],
            &env,
            &log,
        );
        let ready = format!("http://{}/readyz", health.local_addr().expect("addr"));
        let http = reqwest::Client::new();
        let deadline = Instant::now() + WAIT;
        while !http
            .get(&ready)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            let exited = child.try_wait().ok().flatten();
            assert!(
                exited.is_none() && Instant::now() < deadline,
                "the controller never became ready ({exited:?}):\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Controller {
            child,
            _listeners: (facade, health),
        }
    }

    async fn stop(mut self) {
        terminate(&self.child);
        let _ = tokio::time::timeout(Duration::from_secs(60), self.child.wait()).await;
    }
}
