//! Issue 35: the real programs the product exists to drive. The real Gitea and the
//! unmodified official runner (`gitea-runner`), both built from their Go modules by
//! `tests/peers/build.sh`, with the single-host controller between them, started as an
//! operator starts it: `controller --gitea-url URL --registration-token-file FILE`, the
//! runner and nats-server on `PATH`. Workflows are pushed with `git` over HTTP and every
//! assertion reads Gitea's own API (a job's status, conclusion and log) — never a mock's
//! record. Jobs run in the runner's host mode (`run:` steps only; no Docker).

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gdr_testkit::controller::{listener, spawn_activated, terminate};
use gdr_testkit::local_controller::{executor_logs, metric};
use gdr_testkit::nats_server::NatsServer;
use gdr_testkit::real_gitea::{GiteaOptions, Job, Peers, RealGitea};

const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
/// Only a bound on a hang: a job of `run:` steps ends within seconds once its runner runs.
const WAIT: Duration = Duration::from_secs(120);

/// The real Gitea, and a machine for the controller: the official runner and nats-server
/// on `PATH`, the registration token in a file, an empty state directory, and the two
/// listeners systemd would hand over.
struct Host {
    gitea: RealGitea,
    dir: tempfile::TempDir,
    facade: std::net::TcpListener,
    health: std::net::TcpListener,
}

impl Host {
    async fn new(options: GiteaOptions) -> Host {
        let peers = Peers::from_env();
        let gitea = RealGitea::start(&peers, options).await;
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        std::os::unix::fs::symlink(&peers.runner, bin.join("gitea-runner")).unwrap();
        std::os::unix::fs::symlink(NatsServer::binary(), bin.join("nats-server")).unwrap();
        let token = dir.path().join("registration-token");
        std::fs::write(&token, &gitea.registration_token).unwrap();
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
        Host {
            gitea,
            dir,
            facade: listener(),
            health: listener(),
        }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// A directory the jobs (host mode, the controller's user) and the test both reach.
    fn shared(&self, name: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::create_dir_all(&path).unwrap();
        path
    }

    /// The one command, with `env` on top (`POD_CAPACITY`, say).
    fn start(&self, env: &[(&str, &str)]) -> tokio::process::Child {
        let token = self.dir.path().join("registration-token");
        let path = format!(
            "{}:/usr/local/bin:/usr/bin:/bin",
            self.dir.path().join("bin").display()
        );
        let state = self.state().display().to_string();
        let home = self.dir.path().display().to_string();
        let mut vars = vec![
            ("PATH", path.as_str()),
            ("STATE_DIRECTORY", state.as_str()),
            ("HOME", home.as_str()),
        ];
        vars.extend_from_slice(env);
        spawn_activated(
            BIN.as_ref(),
            &[
                "controller",
                "--gitea-url",
                self.gitea.url.as_str(),
                "--registration-token-file",
                &token.display().to_string(),
            ],
            &[("facade", &self.facade), ("health", &self.health)],
            &vars,
            &self.dir.path().join("controller.log"),
        )
    }

    /// What a failure shows: the controller's log, the executors' (the runner's output is
    /// in them) and Gitea's.
    fn logs(&self) -> String {
        format!(
            "controller log:\n{}\nexecutor logs:\n{}\ngitea log (tail):\n{}",
            std::fs::read_to_string(self.dir.path().join("controller.log")).unwrap_or_default(),
            executor_logs(&self.state()),
            tail(&self.gitea.log(), 60),
        )
    }

    async fn repo_with(&self, repo: &str, workflows: &[(&str, &str)]) {
        self.gitea.create_repo(repo).await;
        self.gitea.push_workflows(repo, workflows).await;
    }

    async fn completed(&self, repo: &str, count: usize) -> Vec<Job> {
        self.gitea
            .completed_jobs(repo, count, WAIT, || self.logs())
            .await
    }

    /// Waits until `repo`'s only job is running in an executor of this host.
    async fn running(&self, repo: &str) -> Job {
        let end = tokio::time::Instant::now() + WAIT;
        loop {
            let jobs = self.gitea.jobs(repo).await;
            if let [job] = jobs.as_slice()
                && job.status == "in_progress"
                && self.executors() == 1
            {
                return job.clone();
            }
            assert!(
                tokio::time::Instant::now() < end,
                "{repo}: no job ran: {jobs:#?}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn log_of(&self, repo: &str, job: &Job) -> String {
        self.gitea.job_log(repo, job.id).await
    }

    fn executors(&self) -> usize {
        std::fs::read_dir(self.state().join("pod/executors"))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// Waits until no executor directory is left and no pod slot is in use.
    async fn no_executor_left(&self) {
        let end = tokio::time::Instant::now() + WAIT;
        loop {
            let slots = metric(
                self.health.local_addr().unwrap(),
                "gitea_dynamic_runner_pool_in_use{backend=\"pod\"}",
            )
            .await;
            if self.executors() == 0 && slots == Some(0) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < end,
                "leaked: {} executors, pod slots in use {slots:?}\n{}",
                self.executors(),
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn one_job(runs_on: &str, steps: &str) -> String {
    format!("on: push\njobs:\n  build:\n    runs-on: {runs_on}\n    steps:\n{steps}")
}

async fn stop(child: &mut tokio::process::Child) {
    terminate(child);
    tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("the controller stops on SIGTERM")
        .expect("wait");
}

fn conclusions(jobs: &[Job]) -> Vec<(String, String)> {
    let mut all: Vec<(String, String)> = jobs
        .iter()
        .map(|j| (j.name.clone(), j.conclusion.clone()))
        .collect();
    all.sort();
    all
}

/// DESIGN invariant 16 (the executor runs the unmodified official runner): a job on
/// `[self-hosted, pod]` claimed from the real Gitea runs in the real runner and succeeds,
/// and the log Gitea keeps holds the step's own output (UpdateLog through the facade).
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_job_from_the_real_gitea_succeeds_in_the_real_runner_with_its_log_in_gitea() {
    let host = Host::new(GiteaOptions::default()).await;
    host.repo_with(
        "hello",
        &[(
            "hello.yaml",
            &one_job(
                "[self-hosted, pod]",
                "      - run: echo \"hello from $GITHUB_REPOSITORY at $((6 * 7))\"\n",
            ),
        )],
    )
    .await;
    let mut controller = host.start(&[]);
    let jobs = host.completed("hello", 1).await;
    assert_eq!(jobs[0].conclusion, "success", "{jobs:#?}\n{}", host.logs());
    let log = host.log_of("hello", &jobs[0]).await;
    assert!(
        log.contains("hello from ci/hello at 42"),
        "the step's output is not in Gitea's log:\n{log}\n{}",
        host.logs()
    );
    host.no_executor_left().await;
    stop(&mut controller).await;
}

/// DESIGN invariant 16: a failing step fails the job in Gitea, with the output the step printed before it
/// failed (the runner's own result, passed through unchanged).
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_step_fails_the_job_in_the_real_gitea() {
    let host = Host::new(GiteaOptions::default()).await;
    host.repo_with(
        "failing",
        &[(
            "fail.yaml",
            &one_job(
                "[self-hosted, pod]",
                "      - run: echo about-to-fail; exit 3\n      - run: echo never-printed\n",
            ),
        )],
    )
    .await;
    let mut controller = host.start(&[]);
    let jobs = host.completed("failing", 1).await;
    assert_eq!(jobs[0].conclusion, "failure", "{jobs:#?}\n{}", host.logs());
    let log = host.log_of("failing", &jobs[0]).await;
    assert!(log.contains("about-to-fail"), "{log}");
    assert!(
        !log.contains("never-printed\n"),
        "a step after the failure ran:\n{log}"
    );
    stop(&mut controller).await;
}

/// DESIGN invariant 15 (UpdateTask passes through the facade): with `needs`, the second
/// job starts only after the first succeeded and reads its output, which reached Gitea
/// through the facade's UpdateTask.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_reads_the_outputs_of_the_job_it_needs() {
    let host = Host::new(GiteaOptions::default()).await;
    let yaml = "on: push\njobs:\n  produce:\n    runs-on: [self-hosted, pod]\n    outputs:\n      \
                word: ${{ steps.w.outputs.word }}\n    steps:\n      - id: w\n        \
                run: echo \"word=gdr-$((6 * 7))\" >> \"$GITHUB_OUTPUT\"\n  consume:\n    \
                needs: produce\n    runs-on: [self-hosted, pod]\n    steps:\n      \
                - run: echo \"got ${{ needs.produce.outputs.word }}\"\n";
    host.repo_with("needs", &[("needs.yaml", yaml)]).await;
    let mut controller = host.start(&[]);
    let jobs = host.completed("needs", 2).await;
    assert_eq!(
        conclusions(&jobs),
        [
            ("consume".to_owned(), "success".to_owned()),
            ("produce".to_owned(), "success".to_owned())
        ],
        "{}",
        host.logs()
    );
    let consume = jobs.iter().find(|j| j.name == "consume").unwrap();
    let log = host.log_of("needs", consume).await;
    assert!(
        log.contains("got gdr-42"),
        "the output did not arrive:\n{log}"
    );
    stop(&mut controller).await;
}

/// DESIGN invariants 6, 20 (capacity bounds the executors; nothing runs twice): a matrix of six
/// jobs on a pod capacity of 2 runs every job exactly once, never more than two at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_matrix_of_six_runs_each_job_once_and_never_more_than_the_capacity_at_once() {
    let host = Host::new(GiteaOptions::default()).await;
    let shared = host.shared("matrix");
    std::fs::create_dir(shared.join("running")).unwrap();
    let d = shared.display();
    let yaml = format!(
        "on: push\njobs:\n  m:\n    runs-on: [self-hosted, pod]\n    strategy:\n      matrix:\n        \
         n: [1, 2, 3, 4, 5, 6]\n    steps:\n      - run: |\n          \
         mkdir {d}/running/${{{{ matrix.n }}}}\n          \
         ls {d}/running | wc -l >> {d}/concurrency\n          \
         echo ${{{{ matrix.n }}}} >> {d}/ran\n          sleep 2\n          \
         rmdir {d}/running/${{{{ matrix.n }}}}\n"
    );
    host.repo_with("matrix", &[("matrix.yaml", &yaml)]).await;
    let mut controller = host.start(&[("POD_CAPACITY", "2")]);
    let jobs = host.completed("matrix", 6).await;
    assert!(
        jobs.iter().all(|j| j.conclusion == "success"),
        "{jobs:#?}\n{}",
        host.logs()
    );
    let mut ran: Vec<u32> = std::fs::read_to_string(shared.join("ran"))
        .unwrap()
        .lines()
        .map(|l| l.trim().parse().unwrap())
        .collect();
    ran.sort_unstable();
    assert_eq!(ran, [1, 2, 3, 4, 5, 6], "each matrix job runs exactly once");
    let most = std::fs::read_to_string(shared.join("concurrency"))
        .unwrap()
        .lines()
        .map(|l| l.trim().parse::<u32>().unwrap())
        .max();
    assert!(
        most.is_some_and(|m| m <= 2),
        "more jobs than the capacity ran at once: {most:?}"
    );
    host.no_executor_left().await;
    stop(&mut controller).await;
}

/// DESIGN invariant 7 (a slot is released when the job ends): cancelling the run in Gitea's
/// UI stops the running job — Gitea records it cancelled — and frees its slot: with a pod
/// capacity of 1 the next job runs.
#[tokio::test(flavor = "multi_thread")]
async fn cancelling_a_running_job_in_gitea_stops_it_and_frees_its_slot() {
    let host = Host::new(GiteaOptions::default()).await;
    host.repo_with(
        "cancel",
        &[(
            "long.yaml",
            &one_job(
                "[self-hosted, pod]",
                "      - run: echo waiting-for-cancel; sleep 600\n",
            ),
        )],
    )
    .await;
    let mut controller = host.start(&[("POD_CAPACITY", "1")]);
    let job = host.running("cancel").await;
    host.gitea.cancel_run("cancel", job.run_id).await;
    let jobs = host.completed("cancel", 1).await;
    assert_eq!(
        jobs[0].conclusion,
        "cancelled",
        "{jobs:#?}\n{}",
        host.logs()
    );
    host.no_executor_left().await;

    host.repo_with(
        "after-cancel",
        &[(
            "next.yaml",
            &one_job("[self-hosted, pod]", "      - run: echo next\n"),
        )],
    )
    .await;
    let next = host.completed("after-cancel", 1).await;
    assert_eq!(next[0].conclusion, "success", "{}", host.logs());
    stop(&mut controller).await;
}

/// DESIGN invariant 5 (the backend comes strictly from `runs-on`): a job for a label
/// no backend serves stays waiting in Gitea while a pod job pushed with it runs and ends.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_for_a_label_no_backend_serves_stays_waiting_in_gitea() {
    let host = Host::new(GiteaOptions::default()).await;
    host.repo_with(
        "labels",
        &[
            (
                "gpu.yaml",
                &one_job("[self-hosted, gpu]", "      - run: echo gpu\n"),
            ),
            (
                "pod.yaml",
                &one_job("[self-hosted, pod]", "      - run: echo pod\n"),
            ),
        ],
    )
    .await;
    let mut controller = host.start(&[]);
    let end = tokio::time::Instant::now() + WAIT;
    let jobs = loop {
        let jobs = host.gitea.jobs("labels").await;
        if jobs.iter().filter(|j| j.is_completed()).count() == 1 && jobs.len() == 2 {
            break jobs;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "{jobs:#?}\n{}",
            host.logs()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    // A second pass of the pollers after the pod job ended still leaves it alone.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let jobs_after = host.gitea.jobs("labels").await;
    let waiting: Vec<&Job> = jobs_after.iter().filter(|j| !j.is_completed()).collect();
    assert_eq!(waiting.len(), 1, "{jobs:#?}");
    assert_eq!(
        waiting[0].status,
        "queued",
        "{jobs_after:#?}\n{}",
        host.logs()
    );
    assert!(waiting[0].runner_name.is_empty(), "{jobs_after:#?}");
    stop(&mut controller).await;
}

/// DESIGN invariant 19 (restarts cost no job): the controller SIGKILLed while a job runs
/// and started again — the executor survives, is adopted, and the job ends in Gitea with
/// its real result and its whole log.
#[tokio::test(flavor = "multi_thread")]
async fn a_controller_killed_mid_job_and_restarted_leaves_the_job_its_real_result() {
    let host = Host::new(GiteaOptions::default()).await;
    host.repo_with(
        "killed",
        &[(
            "killed.yaml",
            &one_job(
                "[self-hosted, pod]",
                "      - run: echo first-half; sleep 8; echo second-half\n",
            ),
        )],
    )
    .await;
    let mut first = host.start(&[]);
    let job = host.running("killed").await;
    // Mid-job: the step has printed its first half (Gitea marks the job running when the
    // controller fetches it, before its executor exists).
    let end = tokio::time::Instant::now() + WAIT;
    while !host
        .gitea
        .job_log_so_far("killed", job.id)
        .await
        .is_some_and(|log| log.contains("first-half"))
    {
        assert!(
            tokio::time::Instant::now() < end,
            "the step never started\n{}",
            host.logs()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    first.start_kill().unwrap();
    first.wait().await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut second = host.start(&[]);
    let jobs = host.completed("killed", 1).await;
    assert_eq!(jobs[0].conclusion, "success", "{jobs:#?}\n{}", host.logs());
    let log = host.log_of("killed", &jobs[0]).await;
    assert!(
        log.contains("first-half") && log.contains("second-half"),
        "{log}"
    );
    host.no_executor_left().await;
    stop(&mut second).await;
}

/// DESIGN invariant 5a and docs/restarts.md (down longer than Gitea's zombie timeout): Gitea fails a running task
/// it has not heard of for ZOMBIE_TASK_TIMEOUT (10 minutes by default; 10 s here). The
/// controller stopped that long while a job runs: Gitea's failure stands, the result the
/// executor held is not taken once the controller is back, and the executor is cleaned
/// up.
#[tokio::test(flavor = "multi_thread")]
async fn a_controller_stopped_past_the_zombie_timeout_leaves_the_job_failed_by_gitea() {
    let host = Host::new(GiteaOptions {
        zombie_task_timeout: Some(Duration::from_secs(10)),
    })
    .await;
    host.repo_with(
        "zombie",
        &[(
            "zombie.yaml",
            &one_job(
                "[self-hosted, pod]",
                "      - run: echo before-the-outage; sleep 25; echo after-the-outage\n",
            ),
        )],
    )
    .await;
    let mut first = host.start(&[]);
    host.running("zombie").await;
    stop(&mut first).await;
    let jobs = host.completed("zombie", 1).await;
    assert_eq!(jobs[0].conclusion, "failure", "{jobs:#?}\n{}", host.logs());

    let mut second = host.start(&[]);
    host.no_executor_left().await;
    let jobs = host.gitea.jobs("zombie").await;
    assert_eq!(
        jobs[0].conclusion, "failure",
        "Gitea's failure stands: {jobs:#?}"
    );
    stop(&mut second).await;
}

/// Peer fidelity: the Gitea and the runner the tests above ran against are the versions
/// pinned in tests/peers/go.mod, and README.md and docs/testing.md name those versions.
#[test]
fn the_real_peers_are_the_pinned_versions() {
    let peers = Peers::from_env();
    let pinned =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/peers/go.mod"))
            .unwrap();
    for (binary, module) in [
        (&peers.gitea, "gitea.dev"),
        (&peers.runner, "gitea.com/gitea/runner"),
    ] {
        let version = pinned
            .lines()
            .find_map(|l| l.trim().strip_prefix(&format!("{module} ")))
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("{module} is not pinned in tests/peers/go.mod"));
        let out = std::process::Command::new(binary)
            .arg("--version")
            .output()
            .unwrap();
        let printed = String::from_utf8_lossy(&out.stdout);
        assert!(
            printed.contains(version.trim_start_matches('v')),
            "{} --version says {printed:?}, go.mod pins {version}",
            binary.display()
        );
        // What the operator reads names the versions the tests ran against.
        for doc in ["README.md", "docs/testing.md"] {
            let text =
                std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(doc)).unwrap();
            let bare = version.trim_start_matches('v');
            // The whole version, not a prefix of another one (1.0.8 in 1.0.80).
            let named = text.match_indices(bare).any(|(at, _)| {
                let after = text[at + bare.len()..].chars().next();
                !after.is_some_and(|c| c.is_ascii_digit()) && text[..at].ends_with([' ', 'v', '`'])
            });
            assert!(
                named,
                "{doc} does not name {module} {version}, the version tests/peers/go.mod pins"
            );
        }
    }
}

/// Issue 38 item 4 (DESIGN invariants 11, 13 and 16): the Pod chain with none of the peers
/// that decide the outcome imitated: a job from the real Gitea, its executor Pod created
/// through the real kube-apiserver under the shipped RBAC (the controller started with
/// the one command and a kubeconfig of its ServiceAccount), run on the node stand-in, its
/// SVID from the fake SPIRE agent once the identity entry is bound, and the real runner in
/// it. The job succeeds with its step's output in Gitea's log, and no Pod, Secret or entry
/// is left. (The node is still the test kit's: no container runtime, and the SPIRE agent
/// is the fake one.)
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_job_from_the_real_gitea_runs_the_real_runner_in_a_pod_of_the_real_api_server() {
    use gdr_testkit::controller::FACADE_SPIFFE_ID;
    use gdr_testkit::real_kube::ServiceAccount;
    use gdr_testkit::spiffe::{FakeWorkloadApi, TestCa};
    use k8s_openapi::api::core::v1::{Pod, Secret};
    use kube::Api;
    use kube::api::DynamicObject;

    use crate::real_kube::{IMAGE, NS, cluster, entry_resource, node_a};

    let kube = cluster().await;
    let admin = kube.admin().await;
    let host = Host::new(GiteaOptions::default()).await;
    let nats = NatsServer::start().await.unwrap();
    let node = host.shared("node");
    let ca = TestCa::new("example.org").unwrap();
    let _kubelet = node_a(&kube, &ca, &node).await;
    let kubelet_root = node.join("p");
    let controller_identity = FakeWorkloadApi::start(&node, ca, FACADE_SPIFFE_ID)
        .await
        .unwrap();
    let kubeconfig = node.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        kube.kubeconfig_as(NS, &ServiceAccount::controller()).await,
    )
    .unwrap();
    host.repo_with(
        "podchain",
        &[(
            "ci.yaml",
            &one_job(
                "[self-hosted, pod]",
                "      - run: echo \"from a pod of the real API server, $((6 * 7))\"\n",
            ),
        )],
    )
    .await;

    let runner = Peers::from_env().runner.display().to_string();
    let executor_env = format!("{{ GITEA_RUNNER_BINARY = {runner:?} }}");
    let (nats_url, endpoint) = (nats.url(), controller_identity.endpoint());
    let kubeconfig = kubeconfig.display().to_string();
    // With an external NATS (a cluster's deployment) these have no single-host defaults:
    // the registration writes the runner's credentials where they are named.
    let secrets = host.shared("secrets");
    let key = secrets.join("capability");
    std::fs::write(&key, gdr_testkit::controller::CAPABILITY_KEY).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (uuid, token, key) = (
        secrets.join("uuid").display().to_string(),
        secrets.join("token").display().to_string(),
        key.display().to_string(),
    );
    let facade_url = format!("https://{}", host.facade.local_addr().unwrap());
    let mut controller = host.start(&[
        ("GITEA_RUNNER_UUID_FILE", uuid.as_str()),
        ("GITEA_RUNNER_TOKEN_FILE", token.as_str()),
        ("RUNNER_FACADE_CAPABILITY_KEY_FILE", key.as_str()),
        ("RUNNER_FACADE_URL", facade_url.as_str()),
        ("NATS_URL", nats_url.as_str()),
        ("COMPONENTS", "scheduler,pod-worker"),
        ("VM_CAPACITY", "0"),
        ("POD_BACKEND", "kubernetes"),
        ("POD_NAMESPACE", NS),
        ("POD_EXECUTOR_IMAGE", IMAGE),
        // One container: the node stand-in has no Docker daemon for a sidecar.
        ("POD_PRIVILEGED", "false"),
        ("POD_EXECUTOR_ENV", executor_env.as_str()),
        ("SPIRE_CLUSTER", "test-cluster"),
        ("SPIRE_CLASS", "spire-mgmt"),
        ("LOCAL_IDENTITY", "false"),
        ("TRUST_DOMAIN", "example.org"),
        ("RUNNER_FACADE_SPIFFE_ID", FACADE_SPIFFE_ID),
        ("SPIFFE_ENDPOINT_SOCKET", endpoint.as_str()),
        ("KUBECONFIG", kubeconfig.as_str()),
    ]);
    let pod_logs = || {
        let mut out = String::new();
        for entry in walk(&kubelet_root) {
            if entry.extension().is_some_and(|e| e == "log") {
                let text = std::fs::read_to_string(&entry).unwrap_or_default();
                out.push_str(&format!("== {}\n{}\n", entry.display(), tail(&text, 40)));
            }
        }
        out
    };
    let jobs = host
        .gitea
        .completed_jobs("podchain", 1, WAIT, || {
            format!("{}\npod logs:\n{}", host.logs(), pod_logs())
        })
        .await;
    assert_eq!(
        jobs[0].conclusion,
        "success",
        "{jobs:#?}\n{}\npod logs:\n{}",
        host.logs(),
        pod_logs()
    );
    let log = host.log_of("podchain", &jobs[0]).await;
    assert!(
        log.contains("from a pod of the real API server, 42"),
        "the step's output is not in Gitea's log:\n{log}"
    );
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), NS);
    let entries: Api<DynamicObject> = Api::all_with(admin.clone(), &entry_resource());
    let (pods, secrets, entries) = (&pods, &secrets, &entries);
    gdr_testkit::eventually(WAIT, "no Pod, Secret or entry left", || async move {
        let left = pods.list(&Default::default()).await.unwrap().items.len()
            + secrets.list(&Default::default()).await.unwrap().items.len()
            + entries.list(&Default::default()).await.unwrap().items.len();
        (left == 0).then_some(())
    })
    .await;
    stop(&mut controller).await;
}

/// Every file under `dir`, recursively.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}
