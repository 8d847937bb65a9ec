//! Lease leader election and the fake Kubernetes API server, both driven by the real `kube`
//! client over HTTP. Tests wait on observable state with a deadline, never on fixed sleeps.
//!
//! The election tests protect DESIGN invariant 18. The fake API server tests (the second
//! half) protect no product invariant: they keep the test peer faithful to a real API server
//! in what the election and the Pod backend rely on (optimistic concurrency on
//! `resourceVersion`, `Status` errors, label selectors, merge patches, custom resources), each
//! stated in a `Peer fidelity` line; `Peer harness` lines pin the fake's own test controls.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::FutureExt;
use gdr_controller::lease::{LeaderElector, Leadership, LeaseError, LeaseSettings};
use gdr_controller::shutdown::{Shutdown, ShutdownTrigger, shutdown_channel};
use gdr_testkit::fake_kube::{self, ResourceType, RunningFakeKube, ServiceAccount};
use gdr_testkit::until_sync;
use http::{Method, StatusCode};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

const NS: &str = "ci";
const LEASE: &str = "gitea-dynamic-runner";
/// Generous: only reached when the behaviour under test is broken.
const DEADLINE: Duration = Duration::from_secs(20);

fn client(url: &str) -> kube::Client {
    let config = kube::Config::new(url.parse().expect("fake API URL"));
    kube::Client::try_from(config).expect("kube client")
}

/// The elector's client: the controller's service account, under the shipped RBAC with
/// its Role applied in `NS` too.
fn elector_client(fake: &RunningFakeKube) -> kube::Client {
    fake.handle.enforce_shipped_rbac(&[("gitea-actions", NS)]);
    fake.client_as(&ServiceAccount::controller())
        .expect("kube client")
}

/// Short timings: a 2 s lease, stepping down after 1 s without a renewal.
fn settings(identity: &str) -> LeaseSettings {
    LeaseSettings {
        lease_duration: Duration::from_secs(2),
        renew_deadline: Duration::from_secs(1),
        retry_period: Duration::from_millis(100),
        ..LeaseSettings::new(NS, LEASE, identity)
    }
}

struct Candidate {
    identity: String,
    leadership: Leadership,
    stop: ShutdownTrigger,
    task: JoinHandle<Result<(), LeaseError>>,
}

fn campaign(fake: &RunningFakeKube, settings: LeaseSettings) -> Candidate {
    let identity = settings.identity.clone();
    let (tx, leadership) = Leadership::channel();
    let (stop, stopped) = shutdown_channel();
    let elector = LeaderElector::new(elector_client(fake), settings);
    let task = tokio::spawn(elector.run(tx, stopped));
    Candidate {
        identity,
        leadership,
        stop,
        task,
    }
}

fn stored_lease(fake: &RunningFakeKube) -> Option<Value> {
    fake.handle.object(&ResourceType::leases(), NS, LEASE)
}

fn holder(fake: &RunningFakeKube) -> Option<String> {
    stored_lease(fake)?["spec"]["holderIdentity"]
        .as_str()
        .map(str::to_owned)
}

fn resource_version(fake: &RunningFakeKube) -> u64 {
    stored_lease(fake)
        .and_then(|l| l["metadata"]["resourceVersion"].as_str()?.parse().ok())
        .unwrap_or(0)
}

fn micros(v: &Value) -> i64 {
    let ts: k8s_openapi::jiff::Timestamp =
        v.as_str().expect("timestamp").parse().expect("RFC 3339");
    ts.as_microsecond()
}

/// Waits until exactly one candidate reports leadership and the Lease names it; its identity.
async fn leader_of(fake: &RunningFakeKube, candidates: &[&Candidate]) -> String {
    until_sync(DEADLINE, "one candidate leads", || {
        candidates.iter().any(|c| c.leadership.is_leader())
    })
    .await;
    let leaders: Vec<_> = candidates
        .iter()
        .filter(|c| c.leadership.is_leader())
        .collect();
    assert_eq!(leaders.len(), 1, "exactly one leader");
    let leader = leaders[0];
    assert_eq!(holder(fake).as_deref(), Some(leader.identity.as_str()));
    leader.identity.clone()
}

/// DESIGN invariant 18: of two campaigning replicas exactly one leads, never both at once, and
/// it keeps the Lease by renewing while the standby goes on campaigning.
#[tokio::test]
async fn exactly_one_of_two_candidates_leads() {
    let fake = fake_kube::start().await.expect("fake API");
    let a = campaign(&fake, settings("replica-a"));
    let b = campaign(&fake, settings("replica-b"));

    // Record whether both ever claimed leadership at the same moment.
    let both = Arc::new(AtomicBool::new(false));
    let monitor = {
        let (mut ra, mut rb) = (a.leadership.receiver(), b.leadership.receiver());
        let both = both.clone();
        tokio::spawn(async move {
            loop {
                if *ra.borrow_and_update() && *rb.borrow_and_update() {
                    both.store(true, Ordering::SeqCst);
                }
                tokio::select! {
                    r = ra.changed() => if r.is_err() { break },
                    r = rb.changed() => if r.is_err() { break },
                }
            }
        })
    };

    let leader = leader_of(&fake, &[&a, &b]).await;
    // Let the leader renew several times while the standby keeps campaigning.
    let rv = resource_version(&fake);
    until_sync(DEADLINE, "the leader renewed five times", || {
        resource_version(&fake) >= rv + 5
    })
    .await;
    assert_eq!(holder(&fake).as_deref(), Some(leader.as_str()));
    assert_eq!(
        [a.leadership.is_leader(), b.leadership.is_leader()]
            .iter()
            .filter(|l| **l)
            .count(),
        1
    );
    assert!(!both.load(Ordering::SeqCst), "both candidates led at once");
    assert_eq!(
        stored_lease(&fake).expect("lease")["spec"]["leaseTransitions"],
        0
    );
    monitor.abort();
}

/// Peer fidelity: the fake's optimistic concurrency is the real server's, on which a single
/// leader rests: a write with a stale `resourceVersion` is a `409 Conflict` that changes
/// nothing, a second create `409 AlreadyExists`, a missing object `404`.
#[tokio::test]
async fn a_stale_resource_version_update_is_refused_with_409() {
    let fake = fake_kube::start().await.expect("fake API");
    let leases: Api<Lease> = Api::namespaced(client(&fake.url), NS);
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(LEASE.into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("replica-a".into()),
            ..LeaseSpec::default()
        }),
    };
    let created = leases
        .create(&PostParams::default(), &lease)
        .await
        .expect("create");
    let meta = &created.metadata;
    assert!(meta.uid.as_deref().is_some_and(|u| u.len() == 36));
    assert!(meta.creation_timestamp.is_some());
    let rv1: u64 = meta
        .resource_version
        .as_deref()
        .expect("rv")
        .parse()
        .expect("numeric rv");

    let mut fresh = created.clone();
    fresh.spec.as_mut().expect("spec").holder_identity = Some("replica-b".into());
    let updated = leases
        .replace(LEASE, &PostParams::default(), &fresh)
        .await
        .expect("replace with the current resourceVersion");
    let rv2: u64 = updated
        .metadata
        .resource_version
        .as_deref()
        .expect("rv")
        .parse()
        .expect("numeric rv");
    assert!(rv2 > rv1, "resourceVersion increases");
    assert_eq!(updated.metadata.uid, created.metadata.uid);

    // `created` still carries rv1.
    let mut stale = created.clone();
    stale.spec.as_mut().expect("spec").holder_identity = Some("replica-c".into());
    match leases.replace(LEASE, &PostParams::default(), &stale).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 409);
            assert_eq!(s.reason, "Conflict");
            assert!(s.is_failure());
            assert!(
                s.message.contains("the object has been modified"),
                "{}",
                s.message
            );
        }
        other => panic!("expected a 409 Conflict, got {other:?}"),
    }
    let stored = leases.get(LEASE).await.expect("get");
    assert_eq!(
        stored.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("replica-b"),
        "the refused update changed nothing"
    );

    match leases.create(&PostParams::default(), &lease).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!((s.code, s.reason.as_str()), (409, "AlreadyExists"));
        }
        other => panic!("expected 409 AlreadyExists, got {other:?}"),
    }
    match leases.get("absent").await {
        Err(kube::Error::Api(s)) => assert!(s.is_not_found()),
        other => panic!("expected 404, got {other:?}"),
    }
}

/// DESIGN invariant 18: when the leader dies without releasing (a crash), the standby takes
/// over only after the Lease expired (`renewTime + leaseDurationSeconds`), counting one
/// transition.
#[tokio::test]
async fn killing_the_leader_hands_over_after_the_lease_expires() {
    let fake = fake_kube::start().await.expect("fake API");
    let a = campaign(&fake, settings("replica-a"));
    let b = campaign(&fake, settings("replica-b"));
    let leader_id = leader_of(&fake, &[&a, &b]).await;
    let (dead, standby) = if leader_id == a.identity {
        (a, b)
    } else {
        (b, a)
    };

    // A crash: no release, the Lease keeps naming the dead replica until it expires.
    dead.task.abort();
    let _ = dead.task.await;
    let last = stored_lease(&fake).expect("lease");
    let expires_at = micros(&last["spec"]["renewTime"])
        + last["spec"]["leaseDurationSeconds"]
            .as_i64()
            .expect("duration")
            * 1_000_000;

    until_sync(DEADLINE, "the standby leads", || {
        standby.leadership.is_leader()
    })
    .await;
    let taken = stored_lease(&fake).expect("lease");
    assert_eq!(taken["spec"]["holderIdentity"], standby.identity.as_str());
    assert_eq!(taken["spec"]["leaseTransitions"], 1);
    assert!(
        micros(&taken["spec"]["acquireTime"]) >= expires_at,
        "taken over only after renewTime + leaseDurationSeconds"
    );
}

/// DESIGN invariant 18: a leader that loses the API server stops leading and its elector ends
/// with `Lost`, so the process stops work and exits.
#[tokio::test]
async fn a_leader_that_cannot_renew_steps_down_and_reports_lost() {
    let mut fake = fake_kube::start().await.expect("fake API");
    let mut a = campaign(&fake, settings("replica-a"));
    assert!(a.leadership.acquired().await);

    // The leader loses the API server entirely.
    fake.stop().await;
    until_sync(DEADLINE, "the leader stepped down", || {
        !a.leadership.is_leader()
    })
    .await;
    let result = a.task.await.expect("elector task");
    assert!(matches!(result, Err(LeaseError::Lost)), "{result:?}");
}

/// DESIGN invariant 18: a leader whose renewals fail steps down after the renew deadline,
/// before its Lease can expire and a standby take over, and reports `Lost`.
#[tokio::test]
async fn a_leader_whose_renewals_fail_steps_down_after_the_renew_deadline() {
    let fake = fake_kube::start().await.expect("fake API");
    let mut a = campaign(&fake, settings("replica-a"));
    assert!(a.leadership.acquired().await);

    // The API answers, but every write fails (500 is not retried inside the kube client).
    fake.handle.fail_always(
        Method::PUT,
        "/apis/coordination.k8s.io/v1/namespaces/ci/leases",
        StatusCode::INTERNAL_SERVER_ERROR,
    );
    a.leadership.lost().await;
    let result = a.task.await.expect("elector task");
    assert!(matches!(result, Err(LeaseError::Lost)), "{result:?}");
    assert_eq!(
        holder(&fake).as_deref(),
        Some("replica-a"),
        "no release was possible"
    );
}

/// DESIGN invariant 18: a leader that finds another holder in its Lease (its renewal refused
/// with a 409) steps down at once, long before its renew deadline.
#[tokio::test]
async fn a_leader_whose_lease_was_taken_over_steps_down_at_once() {
    let fake = fake_kube::start().await.expect("fake API");
    // A long lease and deadline: only the 409 can make the leader step down in time.
    let mut a = campaign(
        &fake,
        LeaseSettings {
            lease_duration: Duration::from_secs(60),
            renew_deadline: Duration::from_secs(50),
            ..settings("replica-a")
        },
    );
    assert!(a.leadership.acquired().await);

    let leases: Api<Lease> = Api::namespaced(client(&fake.url), NS);
    // The leader may renew between the intruder's read and its write (a 409 on the stale
    // resourceVersion, seen on a loaded run): the intruder reads again, as a real one would.
    for attempt in 1.. {
        let mut lease = leases.get(LEASE).await.expect("get");
        lease.spec.as_mut().expect("spec").holder_identity = Some("intruder".into());
        match leases.replace(LEASE, &PostParams::default(), &lease).await {
            Ok(_) => break,
            Err(kube::Error::Api(s)) if s.code == 409 && attempt < 10 => {}
            Err(e) => panic!("overwrite: {e}"),
        }
    }

    a.leadership.lost().await;
    let result = a.task.await.expect("elector task");
    assert!(matches!(result, Err(LeaseError::Lost)), "{result:?}");
    assert_eq!(holder(&fake).as_deref(), Some("intruder"));
}

/// Logs at warn and above of this thread's tasks (the elector runs on the test's runtime).
fn capture_warnings() -> (
    gdr_testkit::log_capture::Capture,
    tracing::subscriber::DefaultGuard,
) {
    let captured = gdr_testkit::log_capture::Capture::default();
    let guard = tracing::subscriber::set_default(gdr_controller::logging::subscriber(
        tracing_subscriber::EnvFilter::new("warn"),
        captured.clone(),
    ));
    (captured, guard)
}

/// Writes the Lease as another process holding it under `identity` would renew it: a fresh
/// renewTime on the version read (read again after a 409, as a real writer does).
async fn renew_as_another_process(fake: &RunningFakeKube, identity: &str) {
    let leases: Api<Lease> = Api::namespaced(client(&fake.url), NS);
    for attempt in 1.. {
        let mut lease = leases.get(LEASE).await.expect("get");
        let spec = lease.spec.as_mut().expect("spec");
        spec.holder_identity = Some(identity.into());
        spec.renew_time = Some(MicroTime(k8s_openapi::jiff::Timestamp::now()));
        match leases.replace(LEASE, &PostParams::default(), &lease).await {
            Ok(_) => return,
            Err(kube::Error::Api(s)) if s.code == 409 && attempt < 10 => {}
            Err(e) => panic!("renew: {e}"),
        }
    }
}

/// DESIGN invariant 18: two processes configured with the same identity never both lead.
/// The compare-and-swap cannot tell them apart, so the second, finding the Lease under its
/// own identity renewed by someone else, stays standby and says that the identity is
/// shared.
#[tokio::test]
async fn two_processes_with_the_same_identity_never_both_lead_and_the_duplicate_is_reported() {
    let (captured, _guard) = capture_warnings();
    let fake = fake_kube::start().await.expect("fake API");
    let first = campaign(&fake, settings("replica-a"));
    until_sync(DEADLINE, "the first process leads", || {
        first.leadership.is_leader()
    })
    .await;
    let second = campaign(&fake, settings("replica-a"));
    let both = Arc::new(AtomicBool::new(false));
    let monitor = {
        let (mut ra, mut rb) = (first.leadership.receiver(), second.leadership.receiver());
        let both = both.clone();
        tokio::spawn(async move {
            loop {
                if *ra.borrow_and_update() && *rb.borrow_and_update() {
                    both.store(true, Ordering::SeqCst);
                }
                tokio::select! {
                    r = ra.changed() => if r.is_err() { break },
                    r = rb.changed() => if r.is_err() { break },
                }
            }
        })
    };
    // Several renewals, while the second campaigns.
    let rv = resource_version(&fake);
    until_sync(DEADLINE, "the leader renewed five times", || {
        resource_version(&fake) >= rv + 5
    })
    .await;
    assert!(!both.load(Ordering::SeqCst), "both processes led at once");
    assert!(first.leadership.is_leader(), "the first keeps leading");
    assert!(!second.leadership.is_leader());
    until_sync(DEADLINE, "the duplicate reported", || {
        captured
            .text()
            .contains("another process holds the lease under this replica's identity")
    })
    .await;
    assert!(!both.load(Ordering::SeqCst), "both processes led at once");
    assert!(
        captured.text().contains("\"identity\":\"replica-a\""),
        "the report names the identity: {}",
        captured.text()
    );
    monitor.abort();
}

/// DESIGN invariant 18: a leader whose Lease was renewed under its own identity by another
/// process (a second replica configured with the same `leader_identity`) stops leading at
/// once, long before its renew deadline, and says why: on that identity nobody may lead.
#[tokio::test]
async fn a_leader_whose_identity_another_process_renews_steps_down_and_names_the_duplicate() {
    let fake = fake_kube::start().await.expect("fake API");
    // A long lease and deadline: only the duplicate can make the leader step down in time.
    let mut a = campaign(
        &fake,
        LeaseSettings {
            lease_duration: Duration::from_secs(60),
            renew_deadline: Duration::from_secs(50),
            ..settings("replica-a")
        },
    );
    assert!(a.leadership.acquired().await);
    renew_as_another_process(&fake, "replica-a").await;
    tokio::time::timeout(DEADLINE, a.leadership.lost())
        .await
        .expect("the leader stepped down");
    let result = a.task.await.expect("elector task");
    assert!(
        matches!(&result, Err(LeaseError::DuplicateIdentity(id)) if id == "replica-a"),
        "{result:?}"
    );
}

/// DESIGN invariant 18: a replica restarted under its configured identity after a crash
/// cannot tell its previous run from a live duplicate, so it takes the Lease only once it
/// expired, as any standby, starting a new term.
#[tokio::test]
async fn a_replica_restarted_under_its_identity_takes_the_lease_only_once_its_previous_run_expired()
{
    let fake = fake_kube::start().await.expect("fake API");
    let first = campaign(&fake, settings("replica-a"));
    until_sync(DEADLINE, "the first run leads", || {
        first.leadership.is_leader()
    })
    .await;
    // A crash: no release.
    first.task.abort();
    let _ = first.task.await;
    let last = stored_lease(&fake).expect("lease");
    let expires_at = micros(&last["spec"]["renewTime"])
        + last["spec"]["leaseDurationSeconds"]
            .as_i64()
            .expect("duration")
            * 1_000_000;
    let again = campaign(&fake, settings("replica-a"));
    until_sync(DEADLINE, "the restarted run leads", || {
        again.leadership.is_leader()
    })
    .await;
    let taken = stored_lease(&fake).expect("lease");
    assert_eq!(taken["spec"]["holderIdentity"], "replica-a");
    assert_eq!(taken["spec"]["leaseTransitions"], 1, "a new term");
    assert!(
        micros(&taken["spec"]["acquireTime"]) >= expires_at,
        "taken only after renewTime + leaseDurationSeconds"
    );
}

/// DESIGN invariant 18: an orderly shutdown releases the Lease, so the standby leads at once
/// instead of after the lease duration.
#[tokio::test]
async fn shutdown_releases_the_lease_so_the_standby_takes_over_at_once() {
    let fake = fake_kube::start().await.expect("fake API");
    // A 60 s lease: the standby can only lead within DEADLINE if the lease was released.
    let long = |id: &str| LeaseSettings {
        lease_duration: Duration::from_secs(60),
        renew_deadline: Duration::from_secs(50),
        ..settings(id)
    };
    let a = campaign(&fake, long("replica-a"));
    let b = campaign(&fake, long("replica-b"));
    let leader_id = leader_of(&fake, &[&a, &b]).await;
    let (leader, standby) = if leader_id == a.identity {
        (a, b)
    } else {
        (b, a)
    };

    leader.stop.trigger();
    let result = leader.task.await.expect("elector task");
    assert!(result.is_ok(), "{result:?}");
    assert!(!leader.leadership.is_leader());

    until_sync(DEADLINE, "the standby leads", || {
        standby.leadership.is_leader()
    })
    .await;
    let lease = stored_lease(&fake).expect("lease");
    assert_eq!(lease["spec"]["holderIdentity"], standby.identity.as_str());
    assert_eq!(lease["spec"]["leaseTransitions"], 1);
}

/// DESIGN invariant 18: a standby stopped while campaigning ends cleanly without ever leading
/// and leaves the leader's Lease alone.
#[tokio::test]
async fn shutdown_while_campaigning_returns_ok_without_leading() {
    let fake = fake_kube::start().await.expect("fake API");
    let a = campaign(&fake, settings("replica-a"));
    assert_eq!(leader_of(&fake, &[&a]).await, "replica-a");
    let b = campaign(&fake, settings("replica-b"));
    until_sync(DEADLINE, "the standby has campaigned", || {
        fake.handle
            .requests()
            .iter()
            .filter(|r| r.starts_with("GET"))
            .count()
            >= 2
    })
    .await;
    b.stop.trigger();
    assert!(b.task.await.expect("task").is_ok());
    assert!(!b.leadership.is_leader());
    assert_eq!(holder(&fake).as_deref(), Some("replica-a"));
}

/// DESIGN invariant 18: without leader election (one replica) the process leads from the start
/// and never loses leadership.
#[tokio::test]
async fn a_disabled_election_always_leads() {
    let mut leadership = Leadership::always();
    assert!(leadership.is_leader());
    assert!(leadership.acquired().await);
    let mut copy = leadership.clone();
    drop(leadership);
    assert!(copy.is_leader());
    assert!(
        copy.lost().now_or_never().is_none(),
        "never loses leadership"
    );
    assert!(
        copy.receiver().has_changed().is_ok(),
        "the watch stays open"
    );
}

/// DESIGN invariant 18: lease timings under which two replicas could both believe they lead are
/// refused before campaigning; the defaults are valid.
#[tokio::test]
async fn timings_under_which_two_replicas_could_both_lead_are_rejected() {
    let fake = fake_kube::start().await.expect("fake API");
    let bad = LeaseSettings {
        renew_deadline: Duration::from_secs(3),
        ..settings("replica-a")
    };
    assert!(matches!(bad.validate(), Err(LeaseError::Config(_))));
    let (tx, leadership) = Leadership::channel();
    let result = LeaderElector::new(elector_client(&fake), bad)
        .run(tx, Shutdown::never())
        .await;
    assert!(matches!(result, Err(LeaseError::Config(_))), "{result:?}");
    assert!(!leadership.is_leader());
    assert!(
        LeaseSettings::new(NS, LEASE, "x").validate().is_ok(),
        "defaults are valid"
    );
}

// ----- the fake API server: pods ------------------------------------------------------------

fn pod(name: &str, labels: &[(&str, &str)]) -> Pod {
    fake_kube::minimal_pod(name, labels)
}

fn names(pods: &kube::core::ObjectList<Pod>) -> Vec<String> {
    let mut n: Vec<String> = pods
        .items
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    n.sort();
    n
}

/// Peer fidelity: the fake stores Pods per namespace and answers label-selector lists (`=`,
/// `!=`, several terms, across namespaces), JSON merge patches (`null` removes a key, the spec
/// is left alone, `resourceVersion` moves) and deletes (a second one is `404`) as a real server
/// does.
#[tokio::test]
async fn pods_are_created_listed_by_label_selector_patched_and_deleted() {
    let fake = fake_kube::start().await.expect("fake API");
    let c = client(&fake.url);
    let pods: Api<Pod> = Api::namespaced(c.clone(), NS);
    let pp = PostParams::default();
    let managed = ("app.kubernetes.io/managed-by", "gitea-dynamic-runner");
    pods.create(&pp, &pod("job-1", &[managed, ("backend", "pod")]))
        .await
        .expect("create");
    pods.create(&pp, &pod("job-2", &[managed, ("backend", "vm")]))
        .await
        .expect("create");
    pods.create(&pp, &pod("other", &[("app", "else")]))
        .await
        .expect("create");
    Api::<Pod>::namespaced(c.clone(), "elsewhere")
        .create(&pp, &pod("job-3", &[managed]))
        .await
        .expect("create in another namespace");

    let all = pods.list(&ListParams::default()).await.expect("list");
    assert_eq!(names(&all), ["job-1", "job-2", "other"]);
    let sel = "app.kubernetes.io/managed-by=gitea-dynamic-runner";
    let ours = pods
        .list(&ListParams::default().labels(sel))
        .await
        .expect("list");
    assert_eq!(names(&ours), ["job-1", "job-2"]);
    let both = pods
        .list(&ListParams::default().labels(&format!("{sel},backend=pod")))
        .await
        .expect("list");
    assert_eq!(names(&both), ["job-1"]);
    let not_vm = pods
        .list(&ListParams::default().labels(&format!("{sel},backend!=vm")))
        .await
        .expect("list");
    assert_eq!(names(&not_vm), ["job-1"]);
    let everywhere = Api::<Pod>::all(c.clone())
        .list(&ListParams::default().labels(sel))
        .await
        .expect("list across namespaces");
    assert_eq!(names(&everywhere), ["job-1", "job-2", "job-3"]);

    // Merge patch: add a label and an annotation, remove a label with null.
    let before = pods.get("job-1").await.expect("get");
    let patch = json!({
        "metadata": {
            "labels": { "phase": "finished", "backend": null },
            "annotations": { "runner.example.dev/task": "42" }
        }
    });
    let patched = pods
        .patch("job-1", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("merge patch");
    let labels = patched.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels.get("phase").map(String::as_str), Some("finished"));
    assert!(!labels.contains_key("backend"));
    assert_eq!(
        labels
            .get("app.kubernetes.io/managed-by")
            .map(String::as_str),
        Some("gitea-dynamic-runner")
    );
    assert_eq!(
        patched
            .metadata
            .annotations
            .unwrap_or_default()
            .get("runner.example.dev/task")
            .map(String::as_str),
        Some("42")
    );
    assert_eq!(patched.metadata.uid, before.metadata.uid);
    assert_ne!(
        patched.metadata.resource_version,
        before.metadata.resource_version
    );
    assert_eq!(patched.spec, before.spec, "the patch left the spec alone");
    let finished = pods
        .list(&ListParams::default().labels("phase=finished"))
        .await
        .expect("list");
    assert_eq!(names(&finished), ["job-1"]);

    pods.delete("job-1", &DeleteParams::default())
        .await
        .expect("delete");
    assert!(pods.get_opt("job-1").await.expect("get").is_none());
    match pods.delete("job-1", &DeleteParams::default()).await {
        Err(kube::Error::Api(s)) => assert!(s.is_not_found()),
        other => panic!("expected 404, got {other:?}"),
    }
    let rest = pods
        .list(&ListParams::default().labels(sel))
        .await
        .expect("list");
    assert_eq!(names(&rest), ["job-2"]);
}

/// Peer fidelity: the fake's errors are `Status` objects shaped like the real server's: `404
/// NotFound`, `409 AlreadyExists`, `409 Conflict` for a stale `resourceVersion` by replace or
/// merge-patch precondition, `404` for updating a missing Pod, `415` for an unimplemented patch
/// type.
#[tokio::test]
async fn fake_api_errors_are_status_objects_shaped_like_the_real_servers() {
    let fake = fake_kube::start().await.expect("fake API");
    let pods: Api<Pod> = Api::namespaced(client(&fake.url), NS);
    let created = pods
        .create(&PostParams::default(), &pod("job-1", &[]))
        .await
        .expect("create");

    // Raw shape of a 404, as `kubectl get` would see it.
    let http = reqwest::Client::new();
    let resp = http
        .get(format!("{}/api/v1/namespaces/{NS}/pods/absent", fake.url))
        .send()
        .await
        .expect("GET");
    assert_eq!(resp.status(), 404);
    let body: Value = resp.json().await.expect("json");
    assert_eq!(body["kind"], "Status");
    assert_eq!(body["apiVersion"], "v1");
    assert_eq!(body["status"], "Failure");
    assert_eq!(body["reason"], "NotFound");
    assert_eq!(body["code"], 404);
    assert_eq!(body["message"], "pods \"absent\" not found");
    assert_eq!(body["details"]["name"], "absent");
    assert_eq!(body["details"]["kind"], "pods");
    assert!(body["details"].get("group").is_none(), "core group omitted");

    // 409 AlreadyExists on a second create.
    let resp = http
        .post(format!("{}/api/v1/namespaces/{NS}/pods", fake.url))
        .json(&json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": { "name": "job-1" },
            "spec": { "containers": [{ "name": "job", "image": "runner:latest" }] }
        }))
        .send()
        .await
        .expect("POST");
    assert_eq!(resp.status(), 409);
    let body: Value = resp.json().await.expect("json");
    assert_eq!(
        (
            body["kind"].as_str(),
            body["reason"].as_str(),
            body["code"].as_u64()
        ),
        (Some("Status"), Some("AlreadyExists"), Some(409))
    );
    assert_eq!(body["message"], "pods \"job-1\" already exists");

    // 409 Conflict for a stale resourceVersion, via replace and via a merge-patch precondition.
    pods.patch(
        "job-1",
        &PatchParams::default(),
        &Patch::Merge(json!({ "metadata": { "labels": { "a": "b" } } })),
    )
    .await
    .expect("patch");
    match pods
        .replace("job-1", &PostParams::default(), &created)
        .await
    {
        Err(kube::Error::Api(s)) => assert_eq!((s.code, s.reason.as_str()), (409, "Conflict")),
        other => panic!("expected 409, got {other:?}"),
    }
    let stale_rv = created.metadata.resource_version.clone().expect("rv");
    let precondition =
        json!({ "metadata": { "resourceVersion": stale_rv, "labels": { "c": "d" } } });
    match pods
        .patch(
            "job-1",
            &PatchParams::default(),
            &Patch::Merge(&precondition),
        )
        .await
    {
        Err(kube::Error::Api(s)) => assert_eq!((s.code, s.reason.as_str()), (409, "Conflict")),
        other => panic!("expected 409, got {other:?}"),
    }
    // Pods do not allow create-on-update; patching a missing object is a 404.
    let mut ghost = pod("ghost", &[]);
    ghost.metadata.namespace = Some(NS.into());
    match pods.replace("ghost", &PostParams::default(), &ghost).await {
        Err(kube::Error::Api(s)) => assert!(s.is_not_found()),
        other => panic!("expected 404, got {other:?}"),
    }
    match pods
        .patch("ghost", &PatchParams::default(), &Patch::Merge(json!({})))
        .await
    {
        Err(kube::Error::Api(s)) => assert!(s.is_not_found()),
        other => panic!("expected 404, got {other:?}"),
    }
    // Unimplemented patch types are refused, not silently mis-applied.
    match pods
        .patch(
            "job-1",
            &PatchParams::default(),
            &Patch::Strategic(json!({})),
        )
        .await
    {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 415),
        other => panic!("expected 415, got {other:?}"),
    }
}

/// Peer harness: injected faults answer only matching requests, once (`fail_next`) or until
/// cleared (`fail_always`), as `Status` errors the `kube` client reads.
#[tokio::test]
async fn injected_faults_answer_matching_requests_until_used_up() {
    let fake = fake_kube::start().await.expect("fake API");
    let pods: Api<Pod> = Api::namespaced(client(&fake.url), NS);
    pods.create(&PostParams::default(), &pod("job-1", &[]))
        .await
        .expect("create");
    fake.handle.fail_next(
        Method::GET,
        "/api/v1/namespaces/ci/pods/job-1",
        StatusCode::INTERNAL_SERVER_ERROR,
    );
    match pods.get("job-1").await {
        Err(kube::Error::Api(s)) => {
            assert_eq!((s.code, s.reason.as_str()), (500, "InternalError"));
        }
        other => panic!("expected the injected 500, got {other:?}"),
    }
    assert!(pods.get("job-1").await.is_ok(), "the fault was used up");

    fake.handle
        .fail_always(Method::GET, "/api/v1/", StatusCode::FORBIDDEN);
    for _ in 0..2 {
        match pods.get("job-1").await {
            Err(kube::Error::Api(s)) => assert!(s.is_forbidden()),
            other => panic!("expected 403, got {other:?}"),
        }
    }
    fake.handle.clear_faults();
    assert!(pods.get("job-1").await.is_ok());
}

/// Peer harness: a stopped fake is a transport error (not an API answer), as a dead server is,
/// and a restart keeps its store.
#[tokio::test]
async fn a_stopped_fake_is_unreachable_until_restarted() {
    let mut fake = fake_kube::start().await.expect("fake API");
    let leases: Api<Lease> = Api::namespaced(client(&fake.url), NS);
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(LEASE.into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            renew_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)),
            ..LeaseSpec::default()
        }),
    };
    leases
        .create(&PostParams::default(), &lease)
        .await
        .expect("create");
    fake.stop().await;
    assert!(
        matches!(leases.get(LEASE).await, Err(e) if !matches!(e, kube::Error::Api(_))),
        "a transport error, not an API answer"
    );
    fake.restart().await.expect("restart");
    let back = leases
        .get(LEASE)
        .await
        .expect("the store survived the restart");
    assert_eq!(back.metadata.name.as_deref(), Some(LEASE));
}

/// Peer fidelity: a registered cluster-scoped custom resource (SPIRE's `ClusterStaticEntry`) is
/// served as a real server serves a CRD: create, label list, merge patch and delete through the
/// dynamic API, and no namespaced URL for it.
#[tokio::test]
async fn a_registered_cluster_scoped_custom_resource_is_served() {
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    let fake = fake_kube::start().await.expect("fake API");
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "spire.spiffe.io",
        "v1alpha1",
        "ClusterStaticEntry",
    ));
    let entries: Api<DynamicObject> = Api::all_with(client(&fake.url), &ar);
    let mut entry = DynamicObject::new("task-42", &ar).data(json!({
        "spec": {
            "spiffeID": "spiffe://example.org/task/42",
            "parentID": "spiffe://example.org/spire/agent/k8s_psat/c/0f8fad5b-d9cb-469f-a165-70867728950e",
            "selectors": ["k8s:pod-uid:7c9e6679-7425-40de-944b-e07fc1f90ae7"],
            "className": "spire-mgmt"
        }
    }));
    entry.metadata.labels = Some(BTreeMap::from([("task".to_owned(), "42".to_owned())]));
    let created = entries
        .create(&PostParams::default(), &entry)
        .await
        .expect("create");
    assert!(created.metadata.namespace.is_none(), "cluster-scoped");
    let listed = entries
        .list(&ListParams::default().labels("task=42"))
        .await
        .expect("list");
    assert_eq!(listed.items.len(), 1);
    let patched = entries
        .patch(
            "task-42",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "x509SVIDTTL": "1h" } })),
        )
        .await
        .expect("patch");
    assert_eq!(
        patched.data["spec"]["spiffeID"],
        "spiffe://example.org/task/42"
    );
    assert_eq!(patched.data["spec"]["x509SVIDTTL"], "1h");
    entries
        .delete("task-42", &DeleteParams::default())
        .await
        .expect("delete");
    assert!(entries.get_opt("task-42").await.expect("get").is_none());
    // A namespaced URL for a cluster-scoped kind does not exist.
    let resp = reqwest::get(format!(
        "{}/apis/spire.spiffe.io/v1alpha1/namespaces/{NS}/clusterstaticentries",
        fake.url
    ))
    .await
    .expect("GET");
    assert_eq!(resp.status(), 404);
}
