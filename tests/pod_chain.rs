//! The whole chain through the Pod backend: mock Gitea → scheduler → JetStream (a real
//! nats-server) → pod-worker → the real Kubernetes API server (kube-apiserver and etcd of
//! `gdr_testkit::real_kube`, with the shipped RBAC: the controller calls it as its own
//! ServiceAccount, through a kubeconfig) → the node stand-in (the test kit's kubelet), which
//! runs each Pod's container as a local process: the real `gitea-dynamic-runner executor` → the stand-in runner →
//! the facade (SPIFFE mTLS; the executor's SVID comes from the fake SPIRE agent only once
//! the Pod's ClusterStaticEntry is bound) → mock Gitea.
//!
//! The controller is a real process (socket-activated listeners bound by the test), so it
//! can be SIGKILLed and restarted; its own SVID comes from a Workload API of the same test
//! CA, as a SPIRE agent would serve the controller's Pod.
//!
//! Peers' timeouts named here: the official runner (and the stand-in) give up a final
//! report after 10 s, so a controller restart mid-job must be back well within that; Gitea
//! fails an idle task after 10 min (not reached: every wait below ends far earlier).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gdr_controller::status::{StatusReport, WarmStatus};
use gdr_testkit::controller::{ControllerFixture, FACADE_SPIFFE_ID, Value, listener};
use gdr_testkit::eventually;
use gdr_testkit::fake_kubelet::{FakeKubelet, KubeletConfig};
use gdr_testkit::fake_spire::FakeSpireAgent;
use gdr_testkit::mock_gitea::{JobId, MockConfig, MockGitea, RunningMock, Status};
use gdr_testkit::nats_server::NatsServer;
use gdr_testkit::real_kube::{NODE, PodWatch, RealKube, ServiceAccount};
use gdr_testkit::spiffe::{FakeWorkloadApi, RunningWorkloadApi, TestCa};
use gdr_testkit::standin_dockerd::{Readiness, StandinDockerd, recording_runner, runner_start};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::Api;
use kube::api::{DeleteParams, DynamicObject};

/// Upper bound of every wait (reached only when the behaviour under test is broken).
const WAIT: Duration = Duration::from_secs(90);
const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
const STANDIN: &str = env!("CARGO_BIN_EXE_gitea-runner-standin");
const DOCKERD: &str = env!("CARGO_BIN_EXE_dockerd-standin");
const TRUST_DOMAIN: &str = "example.org";
/// The shipped base's namespace: the controller's Role and the executor's ServiceAccount.
const NS: &str = crate::real_kube::NS;
const CLUSTER: &str = "test-cluster";
const CLASS: &str = "spire-mgmt";
/// The executor image the node stand-in maps to the real binary.
const IMAGE: &str = crate::real_kube::IMAGE;

/// The cluster, NATS, Gitea and a controller configuration; the controller process is
/// started (and killed) by the test.
struct Chain {
    /// First, so that it stops before the API server it watches.
    _recorder: PodWatch,
    mock: RunningMock,
    _cluster: RealKube,
    admin: kube::Client,
    /// Every Pod the API server ever held in [`NS`] (a watch from the start), by UID.
    created: Arc<std::sync::Mutex<BTreeMap<String, Seen>>>,
    _kubelet: FakeKubelet,
    fixture: ControllerFixture,
    /// The stand-in dockerd every privileged Pod's `dockerd` sidecar runs.
    dockerd: StandinDockerd,
    facade: std::net::TcpListener,
    health: std::net::TcpListener,
    kubeconfig: PathBuf,
    _spire: Arc<FakeSpireAgent>,
    _controller_identity: RunningWorkloadApi,
    _nats: NatsServer,
    _dir: tempfile::TempDir,
}

impl Chain {
    /// Everything but the controller; `configure` adds keys to the controller's
    /// configuration (profiles, deadlines).
    async fn new(configure: impl FnOnce(ControllerFixture) -> ControllerFixture) -> Self {
        Self::with_runner(None, configure).await
    }

    /// [`Chain::new`] whose Pods run `runner` (default: the stand-in runner).
    async fn with_runner(
        runner: Option<PathBuf>,
        configure: impl FnOnce(ControllerFixture) -> ControllerFixture,
    ) -> Self {
        let nats = NatsServer::start().await.expect("nats");
        let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
        let kube = crate::real_kube::cluster().await;
        let admin = kube.admin().await;
        let (created, recorder) = record_pods(&admin);
        let dir = tempfile::Builder::new().prefix("pc").tempdir().unwrap();
        std::fs::create_dir(dir.path().join("d")).unwrap();
        let dockerd = StandinDockerd::install(
            &dir.path().join("d"),
            DOCKERD.as_ref(),
            Readiness::After(Duration::from_millis(300)),
        )
        .unwrap();
        let runner = runner.unwrap_or_else(|| PathBuf::from(STANDIN));
        let ca = TestCa::new(TRUST_DOMAIN).unwrap();
        let node_labels = BTreeMap::from([
            ("kubernetes.io/hostname".to_owned(), NODE.to_owned()),
            ("gdr.test/size".to_owned(), "large".to_owned()),
        ]);
        let node_uid = FakeKubelet::register_node(admin.clone(), NODE, &node_labels)
            .await
            .unwrap();
        let agent_id = format!("spiffe://{TRUST_DOMAIN}/spire/agent/k8s_psat/{CLUSTER}/{node_uid}");
        let spire = Arc::new(FakeSpireAgent::start(
            admin.clone(),
            ca.clone(),
            &agent_id,
            CLASS,
            &dir.path().join("s"),
        ));
        let kubelet = FakeKubelet::start(
            admin.clone(),
            KubeletConfig {
                node_name: NODE.into(),
                node_labels,
                images: BTreeMap::from([(IMAGE.to_owned(), PathBuf::from(BIN))]),
                root: dir.path().join("p"),
                spire: Some(spire.clone()),
            },
        )
        .await
        .unwrap();
        let controller_identity = FakeWorkloadApi::start(dir.path(), ca, FACADE_SPIFFE_ID)
            .await
            .unwrap();
        let (facade, health) = (listener(), listener());
        let fixture = ControllerFixture::new(&mock, BIN.as_ref(), STANDIN.as_ref())
            .facade_at(facade.local_addr().unwrap())
            .set("components", "scheduler,pod-worker")
            .set("pod_capacity", 3u32)
            .set("vm_capacity", 0u32)
            .set("nats_url", nats.url())
            .set("heartbeat_interval", "1s")
            .set("nats_ack_wait", "6s")
            // The cluster setup: SPIRE serves every identity, the controller's included.
            .set("local_identity", false)
            .set(
                "spiffe_endpoint_socket",
                controller_identity.endpoint().as_str(),
            )
            .set("pod_backend", "kubernetes")
            .set("pod_namespace", NS)
            .set("pod_executor_image", IMAGE)
            .set("spire_cluster", CLUSTER)
            .set("spire_class", CLASS)
            .set(
                "pod_executor_env",
                Value::Inline(format!(
                    "{{ GITEA_RUNNER_BINARY = {:?}, CI_DOCKERD = {:?} }}",
                    runner.display().to_string(),
                    dockerd.program().display().to_string()
                )),
            )
            .set(
                "pod_profiles",
                Value::Inline(
                    r#"{ large = { limits = { memory = "4Gi" }, node_selector = { "gdr.test/size" = "large" } }, gpu = { runtime_class_name = "nvidia" } }"#
                        .into(),
                ),
            )
            .set("pod_profile_max", Value::Inline(r#"{ memory = "8Gi" }"#.into()));
        let fixture = configure(fixture);
        let kubeconfig = fixture.file(
            "kubeconfig",
            &kube.kubeconfig_as(NS, &ServiceAccount::controller()).await,
        );
        Chain {
            mock,
            _cluster: kube,
            admin,
            created,
            _recorder: recorder,
            _kubelet: kubelet,
            fixture,
            dockerd,
            facade,
            health,
            kubeconfig,
            _spire: spire,
            _controller_identity: controller_identity,
            _nats: nats,
            _dir: dir,
        }
    }

    /// A controller process (with `failpoint` armed, if given).
    fn controller(&self, failpoint: Option<&str>) -> tokio::process::Child {
        let kubeconfig = self.kubeconfig.display().to_string();
        let mut env = vec![("KUBECONFIG", kubeconfig.as_str())];
        if let Some(p) = failpoint {
            env.push(("GDR_FAILPOINT", p));
        }
        self.fixture
            .spawn(BIN.as_ref(), &self.facade, &self.health, &env)
    }

    async fn killed_at_its_fail_point(&self, child: &mut tokio::process::Child) {
        use std::os::unix::process::ExitStatusExt;
        let status = tokio::time::timeout(WAIT, child.wait())
            .await
            .expect("the fail point fires")
            .unwrap();
        assert_eq!(
            status.signal(),
            Some(9),
            "the controller died at its fail point: {status:?}\n{}",
            self.fixture.log()
        );
    }

    fn queue(&self, name: &str, runs_on: &str, step: &str) -> JobId {
        let yaml = format!(
            "on: push\njobs:\n  {name}:\n    runs-on: {runs_on}\n    steps:\n      - run: {step}\n"
        );
        self.mock
            .handle
            .queue_workflow("owner/repo", &yaml)
            .expect("queue")[0]
    }

    async fn status(&self, job: JobId, status: Status) {
        if self
            .mock
            .handle
            .wait_for(|m| m.job(job).is_some_and(|j| j.status == status), WAIT)
            .await
            .is_err()
        {
            let seen = self
                .mock
                .handle
                .job(job)
                .map(|j| (j.status, j.task.map(|t| t.log_rows)));
            panic!(
                "job {job:?} never reached {status:?} (is {seen:?})\ncontroller log:\n{}",
                self.fixture.log()
            );
        }
    }

    /// Waits until the job's runner is running it: its first log row reached Gitea. (A
    /// heartbeat is no sign of it: the controller keeps a queued task alive with its own.)
    async fn running(&self, job: JobId) -> i64 {
        let task = self
            .mock
            .handle
            .wait_for_value(|m| m.job(job).and_then(|j| j.task).map(|t| t.id), WAIT)
            .await
            .unwrap_or_else(|_| panic!("job {job:?} was never fetched\n{}", self.fixture.log()));
        eventually(WAIT, "the job's runner started it", || async {
            (self.runs_of(job) > 0).then_some(())
        })
        .await;
        task
    }

    fn log_rows(&self, job: JobId) -> Vec<String> {
        self.mock.handle.log_rows(job)
    }

    /// How many times the stand-in runner started the job's task.
    fn runs_of(&self, job: JobId) -> usize {
        self.mock.handle.runner_starts(job)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.admin.clone(), NS)
    }

    /// The Pods in [`NS`], as the server holds them.
    async fn pod_list(&self) -> Vec<Pod> {
        self.pods().list(&Default::default()).await.unwrap().items
    }

    /// Waits until no Pod, capability Secret or identity entry is left on the cluster (the
    /// shipped namespace holds no Secret of its own: ServiceAccount tokens are not stored).
    async fn nothing_left(&self) {
        let secrets: Api<Secret> = Api::namespaced(self.admin.clone(), NS);
        let entries: Api<DynamicObject> =
            Api::all_with(self.admin.clone(), &crate::real_kube::entry_resource());
        gdr_testkit::until(WAIT, "no Pod, Secret or entry left", || async {
            let lp = Default::default();
            self.pod_list().await.is_empty()
                && secrets.list(&lp).await.unwrap().items.is_empty()
                && entries.list(&lp).await.unwrap().items.is_empty()
        })
        .await;
    }

    /// How many Pods the API server ever held in [`NS`]: one per creation.
    fn pod_creations(&self) -> usize {
        self.created.lock().unwrap().len()
    }

    /// Every Pod the API server ever held in [`NS`], and the assignments each carried.
    fn seen(&self) -> Vec<Seen> {
        self.created.lock().unwrap().values().cloned().collect()
    }

    /// Waits until `n` unclaimed warm Pods run (their executors wait for a job).
    async fn warm_ready(&self, n: usize) {
        gdr_testkit::until(WAIT, &format!("{n} warm Pods ready"), || async {
            let warm: Vec<Pod> = self
                .pod_list()
                .await
                .into_iter()
                .filter(|p| {
                    p.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(WARM))
                        .map(String::as_str)
                        == Some("true")
                })
                .collect();
            warm.len() == n
                && warm.iter().all(|p| {
                    p.metadata.deletion_timestamp.is_none()
                        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                })
        })
        .await;
    }

    /// Waits until no executor is left: no capability Secret, no identity entry, and no
    /// Pod but the `n` unclaimed warm ones.
    async fn only_the_pool_left(&self, n: usize) {
        let secrets: Api<Secret> = Api::namespaced(self.admin.clone(), NS);
        let entries: Api<DynamicObject> =
            Api::all_with(self.admin.clone(), &crate::real_kube::entry_resource());
        gdr_testkit::until(WAIT, "nothing but the warm pool left", || async {
            let lp = Default::default();
            let pods = self.pod_list().await;
            pods.len() == n
                && pods.iter().all(|p| {
                    p.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(WARM))
                        .map(String::as_str)
                        == Some("true")
                })
                && secrets.list(&lp).await.unwrap().items.is_empty()
                && entries.list(&lp).await.unwrap().items.is_empty()
        })
        .await;
    }

    /// The one Pod that served `job`, asserted to be a pool member.
    fn pool_member_of(&self, job: JobId) -> Seen {
        let id = self.assignment(job);
        let seen = self.seen();
        let served: Vec<&Seen> = seen
            .iter()
            .filter(|p| p.assignments.contains(&id))
            .collect();
        assert_eq!(served.len(), 1, "{id} ran in one Pod: {seen:?}");
        assert!(
            served[0].name.starts_with("gitea-warm-"),
            "{id} ran in a pool member: {seen:?}"
        );
        served[0].clone()
    }

    /// Queues a job whose identity is never bound and waits until it is failed with the
    /// executor's own error, its runner never started.
    async fn fails_unbound(&self) -> JobId {
        let job = self.queue("unbound", "[self-hosted, pod]", "standin:success");
        self.status(job, Status::Failure).await;
        let rows = self.log_rows(job);
        assert!(
            rows.iter()
                .any(|r| r.contains("ended before its runner fetched the task")
                    && r.contains("gave no X.509-SVID")),
            "{rows:?}"
        );
        assert_eq!(self.runs_of(job), 0);
        job
    }

    /// The assignment ID of `job`'s task.
    fn assignment(&self, job: JobId) -> String {
        let task = self
            .mock
            .handle
            .job(job)
            .and_then(|j| j.task_id)
            .expect("fetched");
        format!("gitea-task-{task}")
    }

    async fn pod(&self, job: JobId) -> Option<serde_json::Value> {
        let task = self.mock.handle.job(job)?.task_id?;
        let pod = self
            .pods()
            .get_opt(&format!("gitea-task-{task}"))
            .await
            .unwrap()?;
        Some(serde_json::to_value(pod).unwrap())
    }
}

/// The label of warm Pods (`true` until a job claims one).
const WARM: &str = "ci.ddupan.top/warm";

/// One Pod as the watch saw it over its life.
#[derive(Debug, Clone, Default)]
struct Seen {
    name: String,
    /// Every assignment ID its labels ever carried.
    assignments: std::collections::BTreeSet<String>,
}

/// Records every Pod the API server holds in [`NS`] from now on, by UID.
fn record_pods(admin: &kube::Client) -> (Arc<std::sync::Mutex<BTreeMap<String, Seen>>>, PodWatch) {
    let created = Arc::new(std::sync::Mutex::new(BTreeMap::new()));
    let seen = created.clone();
    let watch = PodWatch::start(Api::namespaced(admin.clone(), NS), move |pod| {
        if let Some(uid) = pod.metadata.uid.clone() {
            let mut seen = seen.lock().unwrap();
            let entry: &mut Seen = seen.entry(uid).or_default();
            entry.name = pod.metadata.name.clone().unwrap_or_default();
            if let Some(id) = pod
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("ci.ddupan.top/assignment-id"))
            {
                entry.assignments.insert(id.clone());
            }
        }
    });
    (created, watch)
}

/// DESIGN invariants 8–11 and 13: success, failure, a checkout (3 MB streamed through the
/// facade's reverse proxy) and cancellation each run in a fresh Pod under its own SPIFFE identity,
/// reach Gitea through the facade, and leave nothing behind; a profile label shapes its
/// Pod; the profiles' labels are declared to Gitea.
#[tokio::test(flavor = "multi_thread")]
async fn jobs_run_in_fresh_pods_with_their_profile_and_every_result_reaches_gitea() {
    let c = Chain::new(|f| f).await;
    let mut controller = c.controller(None);
    let ok = c.queue("ok", "[self-hosted, pod]", "standin:success");
    let bad = c.queue("bad", "[self-hosted, pod]", "standin:failure");
    let checkout = c.queue("checkout", "[self-hosted, pod]", "standin:checkout 3000000");
    let hang = c.queue("hang", "[self-hosted, pod, large]", "standin:hang");
    c.status(ok, Status::Success).await;
    c.status(bad, Status::Failure).await;
    c.status(checkout, Status::Success).await;
    assert!(
        c.log_rows(checkout)
            .iter()
            .any(|r| r == "checkout: received 3000000 bytes"),
        "{:?}",
        c.log_rows(checkout)
    );
    c.running(hang).await;
    let pod = c.pod(hang).await.expect("the hanging job's Pod");
    assert_eq!(pod["spec"]["nodeSelector"]["gdr.test/size"], "large");
    assert_eq!(
        pod["spec"]["containers"][0]["resources"]["limits"]["memory"],
        "4Gi"
    );
    c.mock.handle.cancel_job(hang).unwrap();
    c.status(hang, Status::Cancelled).await;
    c.nothing_left().await;
    assert_eq!(c.pod_creations(), 4, "one Pod per job");
    assert!(
        c.seen().iter().all(|p| p.name.starts_with("gitea-task-")),
        "with no warm pool (the default) every Pod is created for its job: {:?}",
        c.seen()
    );
    let uuid = std::fs::read_to_string(c.fixture.path().join("secrets/uuid")).unwrap();
    let runner = c.mock.handle.runner(uuid.trim()).unwrap();
    assert_eq!(
        runner.labels,
        ["self-hosted", "pod", "gpu", "large"],
        "the profiles' labels are declared"
    );
    let _ = controller.start_kill();
}

/// DESIGN invariant 13: a job in a Pod fetches a JWT-SVID through the SPIRE agent's socket
/// the Pod mounts (what `spire-agent api fetch jwt -audience ci-smoke` does): the token's
/// `sub` is the job's own SPIFFE ID; asking for another job's ID gets nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_job_fetches_a_jwt_svid_of_its_own_spiffe_id_and_nothing_for_another() {
    let c = Chain::new(|f| f).await;
    let mut controller = c.controller(None);
    let own = c.queue("own", "[self-hosted, pod]", "standin:fetch-jwt ci-smoke");
    let other = c.queue(
        "other",
        "[self-hosted, pod]",
        "standin:fetch-jwt ci-smoke spiffe-id=spiffe://example.org/ci/owner/repo/branch/main/own",
    );
    c.status(own, Status::Success).await;
    c.status(other, Status::Failure).await;
    assert!(
        c.log_rows(own).iter().any(|r| r
            == "jwt-svid: sub=spiffe://example.org/ci/owner/repo/branch/main/own aud=ci-smoke"),
        "{:?}",
        c.log_rows(own)
    );
    assert!(
        c.log_rows(other)
            .iter()
            .any(|r| r.starts_with("jwt-svid:") && r.contains("no identity issued")),
        "{:?}",
        c.log_rows(other)
    );
    c.nothing_left().await;
    let _ = controller.start_kill();
}

/// DESIGN invariant 13 on a cluster without the SPIFFE CSI driver: with
/// `pod_spiffe_host_path` the Pod mounts the node agent's directory (`hostPath`) instead of
/// a `csi.spiffe.io` volume, and the job still gets a JWT-SVID of its own SPIFFE ID only.
#[tokio::test(flavor = "multi_thread")]
async fn without_the_csi_driver_a_pod_job_gets_its_own_identity_through_the_node_directory() {
    let c = Chain::new(|f| {
        f.set(
            "pod_spiffe_host_path",
            gdr_testkit::fake_kubelet::AGENT_HOST_DIR,
        )
    })
    .await;
    let mut controller = c.controller(None);
    let own = c.queue("own", "[self-hosted, pod]", "standin:fetch-jwt ci-smoke");
    c.status(own, Status::Success).await;
    assert!(
        c.log_rows(own).iter().any(|r| r
            == "jwt-svid: sub=spiffe://example.org/ci/owner/repo/branch/main/own aud=ci-smoke"),
        "{:?}",
        c.log_rows(own)
    );
    // A held job shows the Pod's volumes while it runs.
    let release = c._dir.path().join("release");
    let held = c.queue(
        "held",
        "[self-hosted, pod]",
        &format!("standin:wait-for {}", release.display()),
    );
    let volumes = gdr_testkit::eventually(WAIT, "the held job's Pod", || async {
        c.pod_list()
            .await
            .first()
            .and_then(|pod| serde_json::to_value(&pod.spec.as_ref()?.volumes).ok())
    })
    .await;
    let volumes = volumes.as_array().expect("volumes").clone();
    assert!(
        volumes.iter().all(|v| v.get("csi").is_none())
            && volumes.iter().any(|v| v["hostPath"]
                == serde_json::json!({"path": gdr_testkit::fake_kubelet::AGENT_HOST_DIR, "type": "Directory"})),
        "{volumes:?}"
    );
    std::fs::write(&release, "").unwrap();
    c.status(held, Status::Success).await;
    c.nothing_left().await;
    let _ = controller.start_kill();
}

/// DESIGN invariant 12: a Pod that cannot pull its image is failed at the start deadline
/// with `ImagePullBackOff` and the kubelet's message, in Gitea and in the controller's log;
/// the mutable tag was warned about at start.
#[tokio::test(flavor = "multi_thread")]
async fn an_image_that_cannot_be_pulled_fails_the_job_with_image_pull_back_off_and_its_message() {
    let c = Chain::new(|f| {
        f.set("executor_start_deadline", "4s").set(
            "pod_profiles",
            Value::Inline(r#"{ broken = { image = "registry.example/missing:latest" } }"#.into()),
        )
    })
    .await;
    let mut controller = c.controller(None);
    let job = c.queue("pull", "[self-hosted, pod, broken]", "standin:success");
    c.status(job, Status::Failure).await;
    let rows = c.log_rows(job);
    assert!(
        rows.iter()
            .any(|r| r.contains("did not start the job within 4s")
                && r.contains(
                    "ImagePullBackOff: Back-off pulling image \"registry.example/missing:latest\""
                )),
        "{rows:?}"
    );
    let log = c.fixture.log();
    assert!(log.contains("ImagePullBackOff"), "{log}");
    assert!(
        log.contains("the image of Pod profile broken is a mutable tag"),
        "{log}"
    );
    c.nothing_left().await;
    let _ = controller.start_kill();
}

/// A job whose extra label selects no profile (the profile was removed while the job was
/// queued), or two profiles, is failed in Gitea with a log row naming the labels, never
/// left waiting; no Pod is created for either.
#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_profile_label_or_two_profiles_fail_the_job_with_a_log_row_naming_them() {
    let mut c = Chain::new(|f| {
        f.set(
            "pod_profiles",
            Value::Inline(r#"{ retired = {}, large = {}, gpu = {} }"#.into()),
        )
    })
    .await;
    // The first controller knows profile `retired`, fetches and queues the job, and dies.
    let mut first = c.controller(Some("after-publish"));
    let retired = c.queue("old", "[self-hosted, pod, retired]", "standin:success");
    c.killed_at_its_fail_point(&mut first).await;
    c.fixture.replace(
        "pod_profiles",
        Value::Inline(r#"{ large = {}, gpu = {} }"#.into()),
    );
    let mut second = c.controller(None);
    let both = c.queue("both", "[self-hosted, pod, large, gpu]", "standin:success");
    c.status(retired, Status::Failure).await;
    c.status(both, Status::Failure).await;
    let rows = c.log_rows(retired);
    assert!(
        rows.iter()
            .any(|r| r.contains("runs-on label \"retired\" selects no Pod profile")),
        "{rows:?}"
    );
    let rows = c.log_rows(both);
    assert!(
        rows.iter()
            .any(|r| r.contains("\"large\"") && r.contains("\"gpu\"")),
        "{rows:?}"
    );
    assert_eq!(c.pod_creations(), 0);
    assert_eq!(c.runs_of(retired) + c.runs_of(both), 0);
    let _ = second.start_kill();
}

/// DESIGN invariant 12: a Pod deleted by someone else mid-job, at once (`--force`, grace
/// 0), ends the job in Gitea at once, not after an idle timeout, and its identity entry goes
/// with it. The real API server marks the Pod (`deletionTimestamp`, grace 0) before it
/// removes it, and a node that sees the mark first signals the containers, as a kubelet
/// does: so either the Pod watch wakes the lifecycle reconciler, which fails the job as
/// gone, or the runner got SIGTERM and reported the cancellation first (Gitea keeps the
/// first result). Both are an end at once; which one comes first is the node's timing.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_deleted_mid_job_fails_the_job_and_leaves_nothing() {
    let c = Chain::new(|f| f).await;
    let mut controller = c.controller(None);
    let job = c.queue("victim", "[self-hosted, pod]", "standin:hang");
    let task = c.running(job).await;
    let pods = c.pods();
    let force = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    pods.delete(&format!("gitea-task-{task}"), &force)
        .await
        .unwrap();
    let ended = c
        .mock
        .handle
        .wait_for_value(
            |m| {
                m.job(job)
                    .map(|j| j.status)
                    .filter(|s| matches!(s, Status::Failure | Status::Cancelled))
            },
            WAIT,
        )
        .await
        .unwrap_or_else(|_| panic!("the job never ended\n{}", c.fixture.log()));
    // The row that says why: the controller's (when its failure came first) or the
    // runner's. When both race, the controller's row may not be stored after the runner's
    // rows (Gitea takes a log row at the index it expects), while its result is.
    let rows = c.log_rows(job);
    assert!(
        rows.iter().any(|r| {
            r.contains("is gone from the pod backend (deleted by someone else")
                || r.contains("received SIGTERM")
        }),
        "{ended:?}: {rows:?}\ncontroller log:\n{}",
        c.fixture.log()
    );
    c.nothing_left().await;
    let _ = controller.start_kill();
}

/// DESIGN invariants 12 and 16: a Pod deleted by someone else mid-job with its grace
/// period, as `kubectl delete` does: the node's kubelet sends the executor SIGTERM, which
/// passes it to its runner, which cancels the job and reports it; the job ends cancelled
/// in Gitea at once (not at the grace period's end), and nothing is left: the Pod is gone
/// before the lifecycle deletes the executor, and its identity entry goes at the next
/// lifecycle pass, not at the backend's sweep 30 s later.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_deleted_gracefully_mid_job_has_its_runner_report_the_cancellation() {
    let c = Chain::new(|f| f).await;
    let mut controller = c.controller(None);
    let job = c.queue("victim", "[self-hosted, pod]", "standin:hang");
    let task = c.running(job).await;
    let pods = c.pods();
    pods.delete(&format!("gitea-task-{task}"), &DeleteParams::default())
        .await
        .unwrap();
    c.status(job, Status::Cancelled).await;
    let rows = c.log_rows(job);
    assert!(
        rows.iter().any(|r| r.contains("received SIGTERM")),
        "{rows:?}"
    );
    c.nothing_left().await;
    let _ = controller.start_kill();
}

/// DESIGN invariants 7 and 9: a controller SIGKILLed while a job runs, and again right
/// after creating another job's Pod, adopts both Pods when it comes back (the claimed one
/// from its labels, the unclaimed one by binding its identity): each job runs exactly
/// once, in the one Pod created for it.
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_controller_adopts_its_pods_on_restart_and_runs_nothing_twice() {
    let c = Chain::new(|f| f).await;
    let mut first = c.controller(None);
    let long = c.queue("long", "[self-hosted, pod]", "standin:sleep 12000");
    c.running(long).await;
    first.start_kill().unwrap();
    first.wait().await.unwrap();
    assert_eq!(
        c.pod_list().await.len(),
        1,
        "the Pod outlives the controller"
    );

    let mut second = c.controller(Some("after-create"));
    let fresh = c.queue("fresh", "[self-hosted, pod]", "standin:success");
    c.killed_at_its_fail_point(&mut second).await;
    assert_eq!(c.pod_list().await.len(), 2);

    let mut third = c.controller(None);
    c.status(fresh, Status::Success).await;
    c.status(long, Status::Success).await;
    assert_eq!(c.runs_of(long), 1, "{:?}", c.log_rows(long));
    assert_eq!(c.runs_of(fresh), 1, "{:?}", c.log_rows(fresh));
    assert_eq!(c.pod_creations(), 2, "no job got a second Pod");
    c.nothing_left().await;
    let _ = third.start_kill();
}

/// Settings under which no executor's identity binds: the entries' parent is a well-formed
/// agent ID of a node that is not the Pod's; the bind deadline short.
fn unbindable(f: ControllerFixture) -> ControllerFixture {
    f.set(
        "spire_agent_id",
        format!(
            "spiffe://{TRUST_DOMAIN}/spire/agent/k8s_psat/{CLUSTER}/00000000-0000-4000-8000-0000000000aa"
        ),
    )
    .set("pod_identity_bind_deadline", "3s")
}

/// DESIGN invariant 13: a job whose identity entry never binds (its parent is not the
/// agent of the Pod's node) gets no SVID, reaches nothing, and is failed after
/// `pod_identity_bind_deadline` with the executor's own error as the reason.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_whose_identity_is_never_bound_is_failed_with_the_executors_error() {
    let c = Chain::new(unbindable).await;
    let mut controller = c.controller(None);
    c.fails_unbound().await;
    c.nothing_left().await;
    let _ = controller.start_kill();
}

/// DESIGN invariant 16 and issue 37 item 3: a privileged Pod's job gets its Docker daemon
/// from the Pod's `dockerd` sidecar: the executor container is not privileged and starts
/// no daemon, the runner starts once the sidecar's daemon answers on the shared socket,
/// with `DOCKER_HOST` pointing at it, and the sidecar ends with the Pod.
#[tokio::test(flavor = "multi_thread")]
async fn a_privileged_pods_job_runs_with_the_docker_daemon_of_its_dockerd_sidecar() {
    let records = tempfile::Builder::new().prefix("pr").tempdir().unwrap();
    let runner = recording_runner(records.path(), STANDIN.as_ref()).unwrap();
    let c = Chain::with_runner(Some(runner), |f| f).await;
    let mut controller = c.controller(None);
    let job = c.queue("docker", "[self-hosted, pod]", "standin:hang");
    c.running(job).await;
    let pod = c.pod(job).await.expect("the job's Pod");
    let executor = &pod["spec"]["containers"][0];
    assert_eq!(
        executor["securityContext"]["privileged"], false,
        "{executor}"
    );
    let sidecar = &pod["spec"]["initContainers"][0];
    assert_eq!(
        (sidecar["name"].as_str(), sidecar["restartPolicy"].as_str()),
        (Some("dockerd"), Some("Always")),
        "{sidecar}"
    );
    assert_eq!(sidecar["securityContext"]["privileged"], true);
    let start = eventually(WAIT, "the runner started", || async {
        runner_start(records.path())
    })
    .await;
    let socket = start
        .docker_host
        .strip_prefix("unix://")
        .expect("DOCKER_HOST is a Unix socket")
        .to_owned();
    assert!(
        socket.ends_with("/volumes/docker-socket/docker.sock"),
        "the shared socket volume: {socket}"
    );
    assert!(
        start.socket_existed,
        "the daemon listened before the runner started"
    );
    assert_eq!(
        c.dockerd.args(),
        Some(vec!["--host".to_owned(), start.docker_host.clone()]),
        "the sidecar's daemon serves the executor's socket"
    );
    c.mock.handle.cancel_job(job).unwrap();
    c.status(job, Status::Cancelled).await;
    c.nothing_left().await;
    gdr_testkit::until(WAIT, "the sidecar's daemon is gone", || async {
        !c.dockerd.running()
    })
    .await;
    let _ = controller.start_kill();
}

/// DESIGN invariant 8 (issue 39 item 5): with a warm pool, jobs are run by pool members
/// (no Pod is created on a job's path), each member serves one job only — claimed by
/// exactly one assignment, deleted after it like any Pod, with its identity entry and
/// capability Secret — and the pool refills to its count, its new members serving later
/// jobs the same way.
#[tokio::test(flavor = "multi_thread")]
async fn with_a_warm_pool_jobs_run_in_pool_members_each_serving_one_job_and_the_pool_refills() {
    let c = Chain::new(|f| f.set("pod_warm_pool", 2u32)).await;
    let mut controller = c.controller(None);
    c.warm_ready(2).await;
    assert_eq!(c.pod_creations(), 2, "the pool, before any job");
    let ok = c.queue("ok", "[self-hosted, pod]", "standin:success");
    let bad = c.queue("bad", "[self-hosted, pod]", "standin:failure");
    c.status(ok, Status::Success).await;
    c.status(bad, Status::Failure).await;
    c.only_the_pool_left(2).await;
    c.warm_ready(2).await;
    let later = c.queue("later", "[self-hosted, pod]", "standin:success");
    c.status(later, Status::Success).await;
    c.only_the_pool_left(2).await;
    let seen = c.seen();
    for job in [ok, bad, later] {
        c.pool_member_of(job);
        assert_eq!(c.runs_of(job), 1);
    }
    assert!(
        seen.iter().all(|p| p.assignments.len() <= 1),
        "no Pod served two jobs: {seen:?}"
    );
    assert!(
        !seen.iter().any(|p| p.name.starts_with("gitea-task-")),
        "no Pod was created on a job's path: {seen:?}"
    );
    // Two at the start, one refill per job.
    assert_eq!(c.pod_creations(), 5, "{seen:?}");
    // The operator sees it: three jobs served by the pool, none missed it.
    let health = c.health.local_addr().unwrap();
    let metric = |series: &'static str| gdr_testkit::local_controller::metric(health, series);
    gdr_testkit::until(WAIT, "the metrics count the claims", || async {
        metric(r#"gitea_dynamic_runner_warm_environment_claims_total{backend="pod",outcome="claimed"}"#).await
            == Some(3)
            && metric(r#"gitea_dynamic_runner_warm_environment_claims_total{backend="pod",outcome="missed"}"#).await
                == Some(0)
    })
    .await;
    // And /status shows the refilled pool.
    let refilled = Some(vec![WarmStatus {
        profile: String::new(),
        ready: 2,
        starting: 0,
    }]);
    gdr_testkit::until(WAIT, "/status shows the refilled pool", || async {
        let Ok(answer) = reqwest::get(format!("http://{health}/status")).await else {
            return false;
        };
        let body = answer.text().await.unwrap_or_default();
        serde_json::from_str::<StatusReport>(&body)
            .is_ok_and(|r| r.backends.first().and_then(|b| b.warm.clone()) == refilled)
    })
    .await;
    let _ = controller.start_kill();
}

/// DESIGN invariants 12 and 13 (issue 39 item 5): a pool member whose identity cannot be
/// bound (its entry's parent is not the agent of its node) gives its job no SVID; the job
/// is failed after `pod_identity_bind_deadline`, counted from the claim, with the
/// executor's own error, and the member is discarded (deleted, never back in the pool),
/// which refills with a new one.
#[tokio::test(flavor = "multi_thread")]
async fn a_pool_member_whose_identity_cannot_be_bound_is_discarded_and_its_job_failed() {
    let c = Chain::new(|f| unbindable(f).set("pod_warm_pool", 1u32)).await;
    let mut controller = c.controller(None);
    c.warm_ready(1).await;
    let job = c.fails_unbound().await;
    c.only_the_pool_left(1).await;
    c.warm_ready(1).await;
    let member = c.pool_member_of(job);
    let left: Vec<String> = c
        .pod_list()
        .await
        .iter()
        .map(|p| p.metadata.name.clone().unwrap_or_default())
        .collect();
    assert!(
        !left.contains(&member.name),
        "the member that could not be bound is gone: {left:?}"
    );
    let _ = controller.start_kill();
}

/// DESIGN invariant 7 (issue 39 item 5): the warm pool is rebuilt from the Pods the cluster
/// holds, not from memory: a killed controller's successor finds the members and creates
/// none beside them, and its jobs are run by them.
#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_controller_finds_the_warm_pool_on_the_cluster_and_creates_no_second_one() {
    let c = Chain::new(|f| f.set("pod_warm_pool", 2u32)).await;
    let mut first = c.controller(None);
    c.warm_ready(2).await;
    first.start_kill().unwrap();
    first.wait().await.unwrap();
    let mut second = c.controller(None);
    let job = c.queue("after", "[self-hosted, pod]", "standin:success");
    c.status(job, Status::Success).await;
    c.only_the_pool_left(2).await;
    c.pool_member_of(job);
    // The two members of the first controller, one refill after the job.
    assert_eq!(c.pod_creations(), 3, "{:?}", c.seen());
    let _ = second.start_kill();
}

/// DESIGN invariant 8 (issue 39 item 5): a member made under earlier settings never runs a
/// job. After a change of the Pod template (here the executors' resources) the next
/// controller deletes the old member before any job and makes a new one, which runs the
/// job.
#[tokio::test(flavor = "multi_thread")]
async fn a_member_made_under_earlier_settings_is_replaced_and_never_claimed() {
    let mut c = Chain::new(|f| f.set("pod_warm_pool", 1u32)).await;
    let mut first = c.controller(None);
    c.warm_ready(1).await;
    let old: Vec<String> = c
        .pod_list()
        .await
        .iter()
        .map(|p| p.metadata.name.clone().unwrap_or_default())
        .collect();
    assert_eq!(old.len(), 1, "{old:?}");
    first.start_kill().unwrap();
    first.wait().await.unwrap();
    c.fixture = c.fixture.set(
        "pod_resources",
        Value::Inline(r#"{ requests = { cpu = "100m" } }"#.into()),
    );
    let mut second = c.controller(None);
    gdr_testkit::until(WAIT, "the old member replaced", || async {
        let pods = c.pod_list().await;
        pods.len() == 1 && pods[0].metadata.name.as_ref() != Some(&old[0])
    })
    .await;
    c.warm_ready(1).await;
    // The operator sees it: one member discarded as outdated, one ready.
    let health = c.health.local_addr().unwrap();
    let metric = |series: &'static str| gdr_testkit::local_controller::metric(health, series);
    gdr_testkit::until(WAIT, "the metrics show the replacement", || async {
        metric(r#"gitea_dynamic_runner_warm_environments_discarded_total{backend="pod",reason="outdated"}"#).await
            == Some(1)
            && metric(r#"gitea_dynamic_runner_warm_environments{backend="pod",profile="",state="ready"}"#).await
                == Some(1)
    })
    .await;
    let job = c.queue("after", "[self-hosted, pod]", "standin:success");
    c.status(job, Status::Success).await;
    c.only_the_pool_left(1).await;
    let member = c.pool_member_of(job);
    assert_ne!(member.name, old[0], "the outdated member ran the job");
    assert!(
        c.fixture
            .log()
            .contains("made from an earlier Pod template"),
        "the deletion says why"
    );
    let _ = second.start_kill();
}

/// DESIGN invariant 8 (issue 39 item 5): a member that never runs (its image cannot be
/// pulled) holds no place in the pool for good: past `executor_start_deadline` it is
/// deleted and replaced, and the log says why. A job arriving meanwhile finds no ready
/// member and gets a Pod of its own, counted as a missed claim.
#[tokio::test(flavor = "multi_thread")]
async fn a_member_that_never_runs_is_replaced_after_the_start_deadline() {
    let c = Chain::new(|f| {
        f.set("executor_start_deadline", "2s")
            .set("pod_warm_pool", 1u32)
            .set("pod_executor_image", "registry.example/missing:latest")
    })
    .await;
    let mut controller = c.controller(None);
    // At most one lifecycle interval (30 s) after the deadline: a Pod waiting on its
    // image changes no more, so no watch event wakes the pass.
    gdr_testkit::until(WAIT, "the stalled member replaced", || async {
        c.pod_creations() >= 2
    })
    .await;
    assert!(
        c.fixture
            .log()
            .contains("not running within executor_start_deadline"),
        "the deletion says why"
    );
    // Its own Pod has the same image: the job fails, after missing the pool.
    let job = c.queue("missed", "[self-hosted, pod]", "standin:success");
    c.status(job, Status::Failure).await;
    let health = c.health.local_addr().unwrap();
    let metric = |series: &'static str| gdr_testkit::local_controller::metric(health, series);
    gdr_testkit::until(WAIT, "the metrics count the missed claim", || async {
        metric(r#"gitea_dynamic_runner_warm_environment_claims_total{backend="pod",outcome="missed"}"#).await
            == Some(1)
            && metric(r#"gitea_dynamic_runner_warm_environment_claims_total{backend="pod",outcome="claimed"}"#).await
                == Some(0)
    })
    .await;
    assert!(
        c.fixture.log().contains("no warm Pod ready for the job"),
        "the job's own Pod says why"
    );
    let _ = controller.start_kill();
}
