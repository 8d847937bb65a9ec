//! Wiring of the `controller` subcommand: settings → adapters → components.
//!
//! [`run`] is a sequence of named steps: credentials, health server, NATS, leadership,
//! identities, backends, dispatch, components, drain. The leader runs everything (pollers,
//! heartbeats, facade, workers, lifecycle reconcilers); a standby only campaigns and answers
//! not-ready (invariant 18). A shutdown or a lost lease stops new fetches first, lets
//! in-flight work finish within bounds (invariant 4) and returns; a lost lease is an error so
//! the process exits non-zero.

mod embedded_nats;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
pub use embedded_nats::EmbeddedNats;
use gdr_backends::process::{ProcessBackend, ProcessBackendSettings};
use gdr_core::assignment::{DerivationPolicy, TaskKey, TaskKeyring};
use gdr_core::backend::Backend;
use gdr_core::capability::CapabilityKey;
use gdr_core::executor::ExecutorBackend;
use gdr_core::metadata::MetadataCodec;
use gdr_identity::workload_api::{LocalCa, LocalIdentity};
use tokio::task::JoinSet;

use crate::dispatch::Dispatch;
use crate::facade::Facade;
use crate::facade::proxy::ReverseProxy;
use crate::gitea::{ClientOptions, Credentials, GiteaClient};
use crate::lease::{LeaderElector, Leadership, LeaseSettings};
use crate::lifecycle::Lifecycle;
use crate::metrics::{BackendLabel, Metrics, OutcomeLabels, Readiness};
use crate::queue::{self, ConsumerSettings, StreamSettings};
use crate::scheduler::{Heartbeater, Scheduler, SchedulerStats};
use crate::settings::{
    self, BackendSettings, GiteaSettings, IdentitySource, LeaderSettings, NatsAuth, NatsServer,
    NatsSettings, PodBackend, ProcessSettings, Settings, TaskKeyFiles, VmBackend, read_secret_file,
};
use crate::shutdown::{Shutdown, ShutdownTrigger, shutdown_channel};
use crate::worker::{Worker, WorkerSettings};

/// JetStream drops a repeated message ID within this window (a retried publish). Two
/// minutes is JetStream's default and far longer than any publish retry loop.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// How long a fetched task's publish is still retried after shutdown is requested: long
/// enough to ride out a NATS restart, short enough for a rolling upgrade.
const SHUTDOWN_PUBLISH_TIMEOUT: Duration = Duration::from_secs(30);
/// After the scheduler stopped fetching, how long the other components get to stop.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(45);
/// How long the elector gets to release the Lease at shutdown (so a standby starts at once).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);
/// How quickly a finished executor is cleaned up; each pass lists the backend once.
const LIFECYCLE_INTERVAL: Duration = Duration::from_secs(2);
/// NAK delay while a pool is full; the executor that frees the slot usually ends well
/// within this.
const FULL_DELAY: Duration = Duration::from_secs(5);
/// NAK delay while an identity target (Pod UID) does not exist yet.
const NOT_READY_DELAY: Duration = Duration::from_secs(2);
/// NAK delay after a backend error, so a broken backend is not hammered.
const ERROR_DELAY: Duration = Duration::from_secs(15);
/// Lifetime of locally issued SVIDs (rotated at half of it).
const LOCAL_SVID_TTL: Duration = Duration::from_secs(3600);
/// How long the process backend waits after SIGTERM before SIGKILL when deleting.
const PROCESS_STOP_GRACE: Duration = Duration::from_secs(10);
/// How often pool and scheduler counters are copied into the metrics.
const METRICS_INTERVAL: Duration = Duration::from_secs(1);

/// Sockets the caller bound (so nothing below `main` picks a port).
pub struct Listeners {
    /// The facade (SPIFFE mTLS).
    pub facade: tokio::net::TcpListener,
    /// `/healthz`, `/readyz`, `/metrics`.
    pub health: tokio::net::TcpListener,
}

/// The cause of a failed start-up step.
pub type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why the controller stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A start-up step failed: unusable secrets, unreachable NATS, a backend that cannot
    /// be built.
    #[error("{step}: {source}")]
    Setup {
        /// What was being set up.
        step: &'static str,
        /// Why it failed.
        #[source]
        source: Source,
    },
    /// This replica lost the leader lease: it stopped working and must exit.
    #[error("lost the leader lease")]
    LostLeadership,
    /// A component stopped although nothing asked it to.
    #[error("{0} stopped unexpectedly")]
    Component(&'static str),
    /// A component failed.
    #[error("{component}: {source}")]
    ComponentFailed {
        /// Which component.
        component: &'static str,
        /// What happened.
        #[source]
        source: Source,
    },
}

fn step(step: &'static str) -> impl FnOnce(Source) -> RuntimeError {
    move |source| RuntimeError::Setup { step, source }
}

fn setup<E: Into<Source>>(name: &'static str) -> impl FnOnce(E) -> RuntimeError {
    move |e| step(name)(e.into())
}

/// Runs the controller until `shutdown` (Ok) or until leadership is lost (Err).
pub async fn run(
    settings: Settings,
    listeners: Listeners,
    shutdown: Shutdown,
) -> Result<(), RuntimeError> {
    let Settings {
        gitea,
        runner,
        policy,
        codec,
        capability_key_file,
        task_keys,
        nats,
        state_dir,
        // Bound by the caller (`listeners.health`).
        health_listen: _,
        identity,
        scheduler,
        pod,
        vm,
        executors,
        leader,
    } = settings;
    let single_host = matches!(nats.server, NatsServer::Embedded { .. });
    let (gitea_client, extra_ca) = gitea_client(&gitea)?;
    let capability_key = capability_key(&capability_key_file)?;
    let keyring = keyring(task_keys)?;

    let metrics = Arc::new(Metrics::new());
    let readiness = Arc::new(Readiness::default());
    let (stop_health, health_shutdown) = shutdown_channel();
    let health = tokio::spawn(crate::metrics::serve(
        listeners.health,
        metrics.clone(),
        readiness.clone(),
        health_shutdown,
    ));

    let queue = Queue::connect(&nats, &state_dir).await?;
    let (mut leadership, elector) = campaign(leader, &stop_health).await?;
    tokio::select! {
        _ = shutdown.wait() => {
            stop_health.trigger();
            let _ = health.await;
            return Ok(());
        }
        acquired = leadership.acquired() => {
            if !acquired {
                stop_health.trigger();
                return Err(RuntimeError::LostLeadership);
            }
        }
    }
    tracing::info!("leading: starting every component");
    metrics.leader.set(1);

    // Backend state (executors, identities) is touched only by the leader: a standby must
    // not re-serve or re-adopt what the leader owns.
    let local = local_identity(&identity, &state_dir, &policy)?;
    let backends = backends(
        pod,
        vm,
        &Wiring {
            state_dir: &state_dir,
            policy: &policy,
            codec: &codec,
            local: local.as_ref(),
        },
    )?;
    let capacities: BTreeMap<Backend, usize> =
        backends.iter().map(|(b, c)| (b.backend(), *c)).collect();
    let dispatch = Arc::new(Dispatch::new(backends, capability_key));
    restore(&dispatch, &capacities).await?;

    // Components. Stopping the scheduler first lets an in-flight fetch publish (4).
    let (stop_scheduler, scheduler_shutdown) = shutdown_channel();
    let (stop_work, work_shutdown) = shutdown_channel();
    let mut tasks: JoinSet<(&'static str, Result<(), Source>)> = JoinSet::new();
    let stats = Arc::new(SchedulerStats::new());
    let labels = settings::declared_labels(&policy.labels, capacities.keys().copied());
    let facade_settings = scheduler.as_ref().map(|s| s.facade.clone());
    // Workers poke it when an assignment leaves the stream, so the backlog gate lets the
    // next fetch through at once.
    let backlog_changed = Arc::new(tokio::sync::Notify::new());
    if let Some(scheduler) = scheduler {
        let facade = Arc::new(Facade::new(
            dispatch.clone(),
            gitea_client.clone(),
            None,
            policy.labels.clone(),
        ));
        spawn_scheduler(
            &mut tasks,
            SchedulerWiring {
                settings: &scheduler,
                labels,
                capabilities: runner.capabilities.clone(),
                pollers: capacities
                    .values()
                    .sum::<usize>()
                    .min(scheduler.fetch_pollers_max)
                    .max(1),
                backlog_changed: &backlog_changed,
                gitea: &gitea_client,
                queue: &queue,
                policy: &policy,
                keyring: keyring.as_ref(),
                stats: &stats,
                facade: &facade,
            },
            &scheduler_shutdown,
        );
        let endpoint = facade_endpoint(
            &identity,
            local.as_ref(),
            &state_dir,
            &scheduler.facade.spiffe_id,
        )
        .await?;
        spawn_facade(
            &mut tasks,
            facade,
            listeners.facade,
            FacadeWiring {
                endpoint: &endpoint,
                trust_domain: policy.trust_domain.as_str(),
                gitea_url: gitea.url.as_str(),
                extra_ca: extra_ca.as_deref(),
            },
            work_shutdown.clone(),
        )
        .await?;
    }
    for (backend, capacity) in &capacities {
        let Some(adapter) = dispatch.backend(*backend) else {
            continue;
        };
        let facade = facade_settings.as_ref();
        let settings = WorkerSettings {
            backend: *backend,
            full_delay: FULL_DELAY,
            not_ready_delay: NOT_READY_DELAY,
            error_delay: ERROR_DELAY,
            progress_interval: nats.ack_wait / 3,
            start_deadline: executors.start_deadline,
            facade_url: facade.map(|f| f.url.clone()).unwrap_or_default(),
            facade_spiffe_id: facade.map(|f| f.spiffe_id.clone()).unwrap_or_default(),
            runner_label: policy.labels.label_of(*backend).to_owned(),
            codec: codec.clone(),
        };
        let consumer = queue
            .consumer(*backend, *capacity, nats.ack_wait, nats.create_stream)
            .await?;
        let worker = Worker::new(
            dispatch.clone(),
            gitea_client.clone(),
            policy.clone(),
            keyring.clone(),
            settings,
        )
        .map_err(setup("starting a worker"))?
        .with_outcomes(count_outcomes(&metrics, *backend))
        .with_backlog_signal(backlog_changed.clone());
        let stop = work_shutdown.clone();
        tasks.spawn(async move {
            worker.run(consumer, stop).await;
            ("worker", Ok(()))
        });
        let lifecycle = Lifecycle::new(
            dispatch.clone(),
            adapter,
            gitea_client.clone(),
            executors.idle_timeout,
        )
        .with_metrics(metrics.clone());
        let stop = work_shutdown.clone();
        tasks.spawn(async move {
            lifecycle.run(LIFECYCLE_INTERVAL, stop).await;
            ("lifecycle", Ok(()))
        });
    }
    tasks.spawn(export_metrics(
        metrics.clone(),
        stats.clone(),
        dispatch.clone(),
        capacities.clone(),
        work_shutdown.clone(),
    ));
    readiness.set(true);
    if single_host {
        tracing::info!("single-host mode: embedded NATS, local executors");
    }

    let outcome = tokio::select! {
        _ = shutdown.wait() => Ok(()),
        _ = leadership.lost() => Err(RuntimeError::LostLeadership),
        Some(joined) = tasks.join_next() => Err(match joined {
            Ok((component, Err(source))) => RuntimeError::ComponentFailed { component, source },
            Ok((component, Ok(()))) => RuntimeError::Component(component),
            Err(e) => RuntimeError::ComponentFailed { component: "task", source: e.into() },
        }),
    };
    // Invariant 4: stop fetching first; an in-flight fetch still publishes (bounded by the
    // scheduler's shutdown publish timeout); then stop the rest.
    readiness.set(false);
    metrics.leader.set(0);
    stop_scheduler.trigger();
    stop_work.trigger();
    let drain = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(DRAIN_TIMEOUT, drain).await.is_err() {
        tracing::warn!(timeout = ?DRAIN_TIMEOUT, "components did not stop in time");
    }
    stop_health.trigger();
    if let Some(e) = elector {
        let _ = tokio::time::timeout(RELEASE_TIMEOUT, e).await;
    }
    let _ = health.await;
    drop(queue);
    outcome
}

// === credentials ===

fn gitea_client(gitea: &GiteaSettings) -> Result<(GiteaClient, Option<Vec<u8>>), RuntimeError> {
    let credentials = Credentials::from_files(&gitea.uuid_file, &gitea.token_file)
        .map_err(setup("reading the runner credentials"))?;
    let extra_ca = match &gitea.ca_file {
        Some(p) => Some(std::fs::read(p).map_err(|e| {
            step("gitea_ca_file")(format!("cannot read {}: {e}", p.display()).into())
        })?),
        None => None,
    };
    let mut options = ClientOptions::new(gitea.url.as_str().trim_end_matches('/'));
    options.extra_ca_pem = extra_ca.clone();
    options.request_timeout = gitea.request_timeout;
    options.fetch_timeout = gitea.fetch_timeout;
    let client = GiteaClient::new(options, Some(&credentials))
        .map_err(setup("building the Gitea client"))?;
    Ok((client, extra_ca))
}

fn capability_key(path: &Path) -> Result<CapabilityKey, RuntimeError> {
    let text = read_secret_file("runner_facade_capability_key_file", path)
        .map_err(setup("reading the capability key"))?;
    CapabilityKey::new(text.as_bytes()).map_err(|e| {
        step("runner_facade_capability_key_file")(format!("{}: {e}", path.display()).into())
    })
}

fn keyring(files: Option<TaskKeyFiles>) -> Result<Option<TaskKeyring>, RuntimeError> {
    let Some(TaskKeyFiles { current, previous }) = files else {
        return Ok(None);
    };
    let load = |path: &PathBuf| -> Result<TaskKey, RuntimeError> {
        let bytes = std::fs::read(path).map_err(|e| {
            step("task_encryption_key_file")(format!("cannot read {}: {e}", path.display()).into())
        })?;
        TaskKey::from_file_contents(&bytes).map_err(|e| {
            step("task_encryption_key_file")(format!("{}: {e}", path.display()).into())
        })
    };
    let previous = previous.iter().map(load).collect::<Result<Vec<_>, _>>()?;
    Ok(Some(TaskKeyring::new(load(&current)?, previous)))
}

// === NATS ===

/// The producer and worker connections, and the embedded server when there is one.
struct Queue {
    producer: jetstream::Context,
    worker: jetstream::Context,
    stream: StreamSettings,
    /// Stopped when the queue is dropped, after every component.
    _embedded: Option<EmbeddedNats>,
}

#[derive(Clone, Copy)]
enum Role {
    Producer,
    Worker,
}

impl Queue {
    async fn connect(nats: &NatsSettings, state_dir: &Path) -> Result<Self, RuntimeError> {
        let stream = StreamSettings {
            stream: nats.stream.clone(),
            subject_base: nats.subject_base.clone(),
            duplicate_window: DUPLICATE_WINDOW,
        };
        let (url, embedded, producer_auth, worker_auth, ca) = match &nats.server {
            NatsServer::Embedded { binary } => {
                let server = EmbeddedNats::start(binary, &state_dir.join("nats"))
                    .await
                    .map_err(setup("starting the embedded nats-server"))?;
                (
                    server.url(),
                    Some(server),
                    NatsAuth::Anonymous,
                    NatsAuth::Anonymous,
                    None,
                )
            }
            NatsServer::External {
                url,
                producer,
                worker,
                ca_file,
            } => (
                url.clone(),
                None,
                producer.clone(),
                worker.clone(),
                ca_file.clone(),
            ),
        };
        let producer = connect(&url, Role::Producer, &producer_auth, ca.as_deref()).await?;
        let worker = connect(&url, Role::Worker, &worker_auth, ca.as_deref()).await?;
        let queue = Queue {
            producer: jetstream::new(producer),
            worker: jetstream::new(worker),
            stream,
            _embedded: embedded,
        };
        if nats.create_stream {
            queue::ensure_stream(&queue.producer, &queue.stream)
                .await
                .map_err(setup("creating the JetStream stream"))?;
        } else {
            queue::open_stream(&queue.producer, &queue.stream)
                .await
                .map_err(setup("opening the JetStream stream"))?;
        }
        Ok(queue)
    }

    async fn consumer(
        &self,
        backend: Backend,
        capacity: usize,
        ack_wait: Duration,
        create: bool,
    ) -> Result<jetstream::consumer::PullConsumer, RuntimeError> {
        let stream = queue::open_stream(&self.worker, &self.stream)
            .await
            .map_err(setup("opening the JetStream stream for a worker"))?;
        let settings = ConsumerSettings {
            max_ack_pending: i64::try_from(capacity).unwrap_or(i64::MAX),
            ack_wait,
            // Unlimited on purpose: a NAK while the pool is full counts as a delivery, so
            // a finite limit would silently strand queued jobs.
            max_deliver: -1,
        };
        if create {
            queue::ensure_consumer(&stream, &self.stream, backend, &settings)
                .await
                .map_err(setup("creating the worker consumer"))
        } else {
            queue::open_consumer(&stream, backend).await.map_err(setup(
                "opening the worker consumer (nats_create_stream = false)",
            ))
        }
    }
}

/// Separate connections and credentials for the producer and the workers, as in the Go
/// version, so each can be granted only what it needs.
async fn connect(
    url: &str,
    role: Role,
    auth: &NatsAuth,
    ca_file: Option<&Path>,
) -> Result<async_nats::Client, RuntimeError> {
    let name = match role {
        Role::Producer => "gitea-dynamic-runner-scheduler",
        Role::Worker => "gitea-dynamic-runner-worker",
    };
    let mut options = match auth {
        NatsAuth::Creds(path) => async_nats::ConnectOptions::with_credentials_file(path.clone())
            .await
            .map_err(|e| {
                step("reading the NATS credentials file")(format!("{}: {e}", path.display()).into())
            })?,
        NatsAuth::Password { user, file, key } => {
            let password = read_secret_file(key, file).map_err(setup("reading a NATS password"))?;
            async_nats::ConnectOptions::new().user_and_password(user.clone(), password)
        }
        NatsAuth::Anonymous => async_nats::ConnectOptions::new(),
    }
    .name(name)
    .retry_on_initial_connect();
    if let Some(ca) = ca_file {
        options = options
            .add_root_certificates(ca.to_path_buf())
            .require_tls(true);
    }
    options.connect(url).await.map_err(|e| {
        step("connecting to NATS")(format!("{}: {e}", settings::redact_url_userinfo(url)).into())
    })
}

// === leadership ===

type ElectorTask = tokio::task::JoinHandle<Result<(), crate::lease::LeaseError>>;

async fn campaign(
    leader: Option<LeaderSettings>,
    stop: &ShutdownTrigger,
) -> Result<(Leadership, Option<ElectorTask>), RuntimeError> {
    let Some(LeaderSettings {
        namespace,
        name,
        identity,
        lease_duration,
    }) = leader
    else {
        return Ok((Leadership::always(), None));
    };
    let client = crate::lease::client_from_environment()
        .await
        .map_err(setup("leader election"))?;
    let identity = identity
        .or_else(|| std::env::var("HOSTNAME").ok())
        .ok_or_else(|| {
            step("leader election")(
                "leader_identity (or HOSTNAME) is required for leader election".into(),
            )
        })?;
    let settings = LeaseSettings::with_duration(namespace, name, identity, lease_duration);
    settings.validate().map_err(setup("leader election"))?;
    let (tx, leadership) = Leadership::channel();
    let elector = tokio::spawn(LeaderElector::new(client, settings).run(tx, stop.signal()));
    Ok((leadership, Some(elector)))
}

// === identities ===

fn local_identity(
    identity: &IdentitySource,
    state_dir: &Path,
    policy: &DerivationPolicy,
) -> Result<Option<Arc<LocalIdentity>>, RuntimeError> {
    match identity {
        IdentitySource::WorkloadApi(_) => Ok(None),
        IdentitySource::Local => {
            let ca = LocalCa::load_or_create(&state_dir.join("ca"), policy.trust_domain.as_str())
                .map_err(setup("loading the local CA"))?;
            Ok(Some(Arc::new(LocalIdentity::new(ca, LOCAL_SVID_TTL))))
        }
    }
}

async fn facade_endpoint(
    identity: &IdentitySource,
    local: Option<&Arc<LocalIdentity>>,
    state_dir: &Path,
    spiffe_id: &str,
) -> Result<String, RuntimeError> {
    match (identity, local) {
        (IdentitySource::WorkloadApi(endpoint), _) => Ok(endpoint.clone()),
        (IdentitySource::Local, Some(local)) => local
            .serve(state_dir.join("facade-workload.sock"), spiffe_id)
            .await
            .map_err(setup("serving the facade's local identity")),
        (IdentitySource::Local, None) => Err(step("serving the facade's local identity")(
            "no local CA".into(),
        )),
    }
}

// === backends ===

/// What building a backend needs besides its own settings.
struct Wiring<'a> {
    state_dir: &'a Path,
    policy: &'a DerivationPolicy,
    codec: &'a MetadataCodec,
    local: Option<&'a Arc<LocalIdentity>>,
}

/// The error of a backend kind this build cannot run yet.
#[derive(Debug, thiserror::Error)]
#[error(
    "the {backend} backend {kind:?} is not supported yet; set {backend}_backend = \"process\" for single-host mode"
)]
struct NotSupported {
    backend: Backend,
    kind: &'static str,
}

/// Each enabled backend's adapter and capacity.
type Backends = Vec<(Arc<dyn ExecutorBackend>, usize)>;

fn backends(
    pod: Option<BackendSettings<PodBackend>>,
    vm: Option<BackendSettings<VmBackend>>,
    wiring: &Wiring<'_>,
) -> Result<Backends, RuntimeError> {
    let mut out: Backends = Vec::new();
    if let Some(pod) = pod {
        let slots = pod.slots();
        let adapter: Arc<dyn ExecutorBackend> = match pod.kind {
            PodBackend::Process(process) => {
                Arc::new(process_backend(Backend::Pod, &process, wiring)?)
            }
            PodBackend::Kubernetes(_) => {
                return Err(setup("building the pod backend")(NotSupported {
                    backend: Backend::Pod,
                    kind: "kubernetes",
                }));
            }
        };
        out.push((adapter, slots));
    }
    if let Some(vm) = vm {
        let slots = vm.slots();
        let adapter: Arc<dyn ExecutorBackend> = match vm.kind {
            VmBackend::Process(process) => {
                Arc::new(process_backend(Backend::Vm, &process, wiring)?)
            }
            VmBackend::OpenSandbox(_) => {
                return Err(setup("building the vm backend")(NotSupported {
                    backend: Backend::Vm,
                    kind: "opensandbox",
                }));
            }
        };
        out.push((adapter, slots));
    }
    Ok(out)
}

fn process_backend(
    backend: Backend,
    process: &ProcessSettings,
    wiring: &Wiring<'_>,
) -> Result<ProcessBackend, RuntimeError> {
    let identity = wiring.local.cloned().ok_or_else(|| {
        step("building the process backend")(
            "the process backend needs local_identity = true".into(),
        )
    })?;
    let program = match &process.program {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(setup("locating this binary for executors"))?,
    };
    let settings = ProcessBackendSettings {
        backend,
        state_root: wiring.state_dir.join(backend.as_str()),
        program,
        args: vec!["executor".into()],
        extra_env: BTreeMap::from([(
            "GITEA_RUNNER_BINARY".to_owned(),
            process.runner_binary.display().to_string(),
        )]),
        codec: wiring.codec.clone(),
        trust_domain: wiring.policy.trust_domain.clone(),
        stop_grace: PROCESS_STOP_GRACE,
    };
    ProcessBackend::new(settings, identity).map_err(setup("building the process backend"))
}

async fn restore(
    dispatch: &Dispatch,
    capacities: &BTreeMap<Backend, usize>,
) -> Result<(), RuntimeError> {
    for backend in capacities.keys() {
        if let Some(adapter) = dispatch.backend(*backend) {
            let records = adapter
                .list()
                .await
                .map_err(setup("listing executors to restore"))?;
            let (admitted, claimed) = dispatch.restore(&records);
            tracing::info!(%backend, admitted, claimed, "restored executors from the backend");
        }
    }
    Ok(())
}

// === components ===

struct SchedulerWiring<'a> {
    settings: &'a settings::SchedulerSettings,
    labels: Vec<String>,
    capabilities: Vec<String>,
    pollers: usize,
    backlog_changed: &'a Arc<tokio::sync::Notify>,
    gitea: &'a GiteaClient,
    queue: &'a Queue,
    policy: &'a DerivationPolicy,
    keyring: Option<&'a TaskKeyring>,
    stats: &'a Arc<SchedulerStats>,
    facade: &'a Arc<Facade>,
}

fn spawn_scheduler(
    tasks: &mut JoinSet<(&'static str, Result<(), Source>)>,
    w: SchedulerWiring<'_>,
    shutdown: &Shutdown,
) {
    let mut poller_settings = crate::scheduler::SchedulerSettings::new(
        w.labels,
        w.capabilities,
        w.pollers,
        w.settings.backlog_limit,
    );
    poller_settings.shutdown_publish_timeout = SHUTDOWN_PUBLISH_TIMEOUT;
    let mut scheduler = Scheduler::new(
        w.gitea.clone(),
        w.queue.producer.clone(),
        w.queue.stream.clone(),
        w.policy.clone(),
        poller_settings,
    )
    .with_stats(w.stats.clone())
    .with_backlog_signal(w.backlog_changed.clone());
    if let Some(k) = w.keyring {
        scheduler = scheduler.with_keyring(Arc::new(k.clone()));
    }
    // The facade passes Gitea's capabilities header from the one Declare on to runners.
    let mut declared = scheduler.declared();
    let facade = w.facade.clone();
    tokio::spawn(async move {
        if let Ok(d) = declared.wait_for(Option::is_some).await {
            facade.set_server_capabilities(d.as_ref().and_then(|d| d.server_capabilities.clone()));
        }
    });
    let stop = shutdown.clone();
    tasks.spawn(async move {
        (
            "scheduler",
            scheduler.run(stop).await.map(|_| ()).map_err(Source::from),
        )
    });
    let heartbeater = Heartbeater::new(
        w.gitea.clone(),
        w.queue.producer.clone(),
        w.queue.stream.clone(),
        w.settings.heartbeat_interval,
    )
    .with_stats(w.stats.clone());
    let stop = shutdown.clone();
    tasks.spawn(async move {
        heartbeater.run(stop).await;
        ("heartbeater", Ok(()))
    });
}

struct FacadeWiring<'a> {
    endpoint: &'a str,
    trust_domain: &'a str,
    gitea_url: &'a str,
    extra_ca: Option<&'a [u8]>,
}

async fn spawn_facade(
    tasks: &mut JoinSet<(&'static str, Result<(), Source>)>,
    facade: Arc<Facade>,
    listener: tokio::net::TcpListener,
    w: FacadeWiring<'_>,
    shutdown: Shutdown,
) -> Result<(), RuntimeError> {
    let source = gdr_identity::tls::x509_source(w.endpoint)
        .await
        .map_err(setup("obtaining the facade's SVID"))?;
    let tls = Arc::new(
        gdr_identity::tls::facade_server_config(&source, w.trust_domain)
            .map_err(setup("building the facade's TLS configuration"))?,
    );
    let proxy =
        ReverseProxy::new(w.gitea_url, w.extra_ca).map_err(setup("building the reverse proxy"))?;
    tasks.spawn(async move {
        // The source must live as long as the server: it rotates the SVID.
        let _source = source;
        let result = facade.serve(listener, tls, proxy, shutdown).await;
        ("facade", result.map_err(Source::from))
    });
    Ok(())
}

fn count_outcomes(
    metrics: &Arc<Metrics>,
    backend: Backend,
) -> tokio::sync::mpsc::UnboundedSender<(String, crate::worker::Outcome)> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let metrics = metrics.clone();
    tokio::spawn(async move {
        while let Some((_, outcome)) = rx.recv().await {
            let outcome: crate::worker::Outcome = outcome;
            metrics
                .assignments
                .get_or_create(&OutcomeLabels {
                    backend: backend.as_str().into(),
                    outcome: outcome.as_str().into(),
                })
                .inc();
        }
    });
    tx
}

/// Copies the scheduler's counters and the pools into Prometheus every second.
async fn export_metrics(
    metrics: Arc<Metrics>,
    stats: Arc<SchedulerStats>,
    dispatch: Arc<Dispatch>,
    capacities: BTreeMap<Backend, usize>,
    stop: Shutdown,
) -> (&'static str, Result<(), Source>) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut last = (0u64, 0u64, 0u64);
    loop {
        let now = (
            stats.tasks_fetched.load(Relaxed),
            stats.publish_retries.load(Relaxed),
            stats.heartbeats_sent.load(Relaxed),
        );
        metrics.tasks_fetched.inc_by(now.0.saturating_sub(last.0));
        metrics.publish_retries.inc_by(now.1.saturating_sub(last.1));
        metrics.heartbeats.inc_by(now.2.saturating_sub(last.2));
        last = now;
        metrics
            .handoff_window_max_micros
            .set(i64::try_from(stats.handoff_window_micros_max.load(Relaxed)).unwrap_or(i64::MAX));
        for kind in crate::scheduler::ERROR_KINDS {
            let counter = metrics
                .gitea_errors
                .get_or_create(&crate::metrics::ErrorKindLabel {
                    kind: kind.as_str().into(),
                });
            let total = stats.fetch_errors(kind);
            counter.inc_by(total.saturating_sub(counter.get()));
        }
        for backend in capacities.keys() {
            let (in_use, capacity) = dispatch.pool_usage(*backend);
            let label = BackendLabel {
                backend: backend.as_str().into(),
            };
            metrics
                .pool_in_use
                .get_or_create(&label)
                .set(i64::try_from(in_use).unwrap_or(i64::MAX));
            metrics
                .pool_capacity
                .get_or_create(&label)
                .set(i64::try_from(capacity).unwrap_or(i64::MAX));
        }
        if !stop.sleep(METRICS_INTERVAL).await {
            return ("metrics", Ok(()));
        }
    }
}
