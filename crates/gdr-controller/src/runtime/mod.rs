//! Wiring of the `controller` subcommand: settings → adapters → components.
//!
//! [`run`] is a sequence of named steps: credentials, health server, NATS, leadership,
//! identities, backends, dispatch, components, drain. The leader runs everything (pollers,
//! heartbeats, facade, workers, lifecycle reconcilers); a standby only campaigns and answers
//! not-ready (invariant 18). A shutdown or a lost lease stops new fetches first, lets
//! in-flight work finish within bounds (invariant 4) and returns; a lost lease is an error so
//! the process exits non-zero.

mod backends;
mod embedded_nats;
pub mod first_start;
pub mod metrics;
mod nats;
pub mod sandbox_identity;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

pub use backends::EXECUTOR_BINARY;
pub use embedded_nats::{EmbeddedNats, EmbeddedNatsError, Launch, exec_bound_to_parent};
use gdr_core::assignment::{DerivationPolicy, TaskKey, TaskKeyring};
use gdr_core::backend::Backend;
use gdr_core::capability::{CapabilityKey, EnvelopeIdKey};
use gdr_core::executor::ExecutorBackend;
use gdr_core::metadata::MetadataCodec;
use gdr_identity::workload_api::{LocalCa, LocalIdentity};
use tokio::task::JoinSet;

use self::backends::{Extras, Wiring, backends, restore, terminal_grace};
use self::nats::{Queue, queue_depth, watch_nats};
use crate::dispatch::Dispatch;
use crate::facade::{BackendStandbys, ExecutorChannel};
use crate::health::Health;
use crate::held::HeldAssignments;
use crate::job_metrics::{JobMetrics, OutcomeLabels};
use crate::lease::{LeaderElector, Leadership, LeaseSettings};
use crate::lifecycle::Lifecycle;
use crate::metrics::{BackendLabel, Metrics};
use crate::queue::{self, FinishedAssignments};
use crate::scheduler::{Heartbeater, Scheduler, SchedulerStats};
use crate::settings::{
    self, BackendSettings, ExecutorTimings, FacadeLimits, FacadeSettings, GiteaSettings,
    IdentitySource, KeyFile, LeaderSettings, NatsServer, NatsSettings, PodBackend,
    SecretPermissions, Settings, TaskKeyFiles, VmBackend, check_secret_file_mode,
    read_secret_file_with,
};
use crate::shutdown::{Shutdown, ShutdownTrigger, shutdown_channel};
use crate::status::{Observations, Observed, QueueDepth};
use crate::worker::{EnvelopeTrust, Worker, WorkerSettings};
use gdr_facade::Facade;
use gdr_facade::proxy::ReverseProxy;
use gdr_facade::tls::FacadeStats;
use gdr_gitea::{ClientOptions, Credentials, GiteaClient};

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
/// How often the pools' and the queues' gauges are sampled.
const METRICS_INTERVAL: Duration = Duration::from_secs(1);
/// How often held assignments (sealed with an unknown task key) are looked at.
const HELD_INTERVAL: Duration = Duration::from_secs(30);
/// The facade may hold at most this fraction of the open-file limit: each connection can
/// bring an upstream connection to Gitea, and executors, NATS and the health server need
/// descriptors too.
const FACADE_SHARE_OF_OPEN_FILES: u64 = 4;

/// Sockets the caller bound (so nothing below `main` picks a port).
pub struct Listeners {
    /// The facade (SPIFFE mTLS).
    pub facade: tokio::net::TcpListener,
    /// `/healthz`, `/readyz`, `/metrics`, `/status` and the status page.
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

/// A cause with what it concerns (a file, a URL): the text leads with that, and the cause
/// stays reachable as the source, so a log line or `/status` can walk the whole chain.
#[derive(Debug, thiserror::Error)]
#[error("{context}: {source}")]
pub struct InContext {
    context: String,
    #[source]
    source: Source,
}

/// `source`, said to concern `context` (a path, a redacted URL).
pub(crate) fn in_context(context: impl std::fmt::Display, source: impl Into<Source>) -> Source {
    Box::new(InContext {
        context: context.to_string(),
        source: source.into(),
    })
}

fn step(step: &'static str) -> impl FnOnce(Source) -> RuntimeError {
    move |source| RuntimeError::Setup { step, source }
}

fn setup<E: Into<Source>>(name: &'static str) -> impl FnOnce(E) -> RuntimeError {
    move |e| step(name)(e.into())
}

/// The future of a whole program (controller, `sandbox-identity`), boxed at the crate
/// boundary: its state machine is then compiled once, here. Polled as an opaque type from the
/// binary, release builds (which share no generic instantiation across crates) compiled the
/// entire async call tree a second time there, about two minutes of a cold release build.
pub type Program = Pin<Box<dyn Future<Output = Result<(), RuntimeError>> + Send>>;

/// Runs the controller until `shutdown` (Ok) or until leadership is lost (Err).
pub fn run(settings: Settings, listeners: Listeners, shutdown: Shutdown) -> Program {
    Box::pin(run_controller(settings, listeners, shutdown))
}

/// The wiring: reads the credentials, serves health, connects NATS, campaigns, and once
/// leading adopts the backends and starts the scheduler, the facade and the workers; stops
/// them in order (invariant 4).
async fn run_controller(
    settings: Settings,
    listeners: Listeners,
    shutdown: Shutdown,
) -> Result<(), RuntimeError> {
    // The enabled backends' labels and the labels the Pod profiles add.
    let labels = settings.declared_labels();
    let single_host = settings.single_host();
    let open_files = open_files();
    let (capability_key, prepared) = prepare(&settings, labels.clone()).await?;
    let Settings {
        gitea,
        runner,
        policy,
        codec,
        // Read by `prepare`.
        capability_key_file: _,
        task_keys: _,
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
        secrets,
    } = settings;

    let health = HealthServer::start(listeners.health);
    let metrics = health.state.metrics.clone();
    let queue = Queue::connect(&nats, &state_dir, secrets).await?;
    tokio::spawn(watch_nats(metrics.clone(), &queue, health.stopped.clone()));
    let (mut leadership, elector) = campaign(leader, &health.stop).await?;
    if !lead(&mut leadership, &shutdown, &health.stop).await? {
        let _ = health.task.await;
        return Ok(());
    }
    metrics.leader.set(1);

    // Backend state (executors, identities) is touched only by the leader: a standby must
    // not re-serve or re-adopt what the leader owns.
    let local = local_identity(&identity, &state_dir, &policy)?;
    let vm_terminal_grace = vm.as_ref().and_then(terminal_grace);
    let wiring = Wiring::new(
        &state_dir,
        &policy,
        &codec,
        &identity,
        local.as_ref(),
        secrets,
    );
    let finished = queue.finished(&nats).await?;
    let (dispatch, capacities, extras) = adopt(pod, vm, &wiring, capability_key, &finished).await?;
    health.init_backends(capacities.keys());

    // Components. Stopping the scheduler first lets an in-flight fetch publish (4).
    let (stop_scheduler, scheduler_shutdown) = scheduler_stop(&leadership);
    let (stop_work, work_shutdown) = shutdown_channel();
    let components = Components {
        prepared: &prepared,
        health: &health,
        queue: &queue,
        leadership: &leadership,
        dispatch: &dispatch,
        capacities: &capacities,
        finished: &finished,
        local: local.as_ref(),
        gitea: &gitea,
        capabilities: &runner.capabilities,
        labels,
        nats: &nats,
        executors: &executors,
        policy: &policy,
        codec: &codec,
        identity: &identity,
        state_dir: &state_dir,
        open_files: &open_files,
        vm_terminal_grace,
    };
    // Without a scheduler nothing serves the facade's listener; it stays bound until the end.
    let (mut tasks, _unserved_facade) = spawn_components(
        components,
        scheduler,
        listeners.facade,
        extras,
        (&scheduler_shutdown, &work_shutdown),
    )
    .await?;
    if single_host {
        tracing::info!("single-host mode: embedded NATS, local executors");
    }

    let outcome = run_until_stopped(&mut tasks, &shutdown, &mut leadership).await;
    health.not_ready();
    wind_down(tasks, [stop_scheduler, stop_work, health.stop], elector).await;
    let _ = health.task.await;
    drop(queue);
    outcome
}

/// What the start-up steps before serving health establish for the components: the Gitea
/// client and the keys (the capability key itself goes to the dispatch).
struct Prepared {
    gitea: GiteaClient,
    /// `gitea_ca_file`'s contents (the facade's upstream trusts them too).
    extra_ca: Option<Vec<u8>>,
    envelope_id_key: EnvelopeIdKey,
    /// `None`: plaintext envelopes.
    keyring: Option<TaskKeyring>,
}

/// Registers the runner (first start) with `labels`, reads the credentials and the keys,
/// warns about weakening compatibility settings and makes the state directory private
/// where something keeps state there. Returns the capability key and the rest.
async fn prepare(
    settings: &Settings,
    labels: Vec<String>,
) -> Result<(CapabilityKey, Prepared), RuntimeError> {
    let secrets = settings.secrets;
    first_start::ensure_registered(&settings.gitea, &settings.runner, labels)
        .await
        .map_err(setup("registering the runner"))?;
    let (gitea, extra_ca) = gitea_client(&settings.gitea, secrets)?;
    let writes_envelopes = settings.scheduler.is_some();
    let (capability_key, envelope_id_key, keyring) = keys(
        &settings.capability_key_file,
        settings.task_keys.as_ref(),
        &settings.state_dir,
        (settings.single_host(), writes_envelopes),
        secrets,
    )?;
    warn_about_compatibility(&settings.nats, &settings.policy, keyring.is_some());
    let (pod, vm) = (settings.pod.as_ref(), settings.vm.as_ref());
    if uses_state_dir(&settings.nats, &settings.identity, pod, vm) {
        private_dir(&settings.state_dir).map_err(|e| step("state_dir")(e.into()))?;
    }
    let prepared = Prepared {
        gitea,
        extra_ca,
        envelope_id_key,
        keyring,
    };
    Ok((capability_key, prepared))
}

/// The health listener (`/healthz`, `/readyz`, `/metrics`, `/status`), served from start-up
/// on, a standby's included, with the metrics the components register themselves.
struct HealthServer {
    state: Health,
    /// The scheduler's, the facade's and the job steps' metrics, in `state`'s registry.
    stats: Arc<SchedulerStats>,
    facade_stats: Arc<FacadeStats>,
    jobs: Arc<JobMetrics>,
    /// Stops the listener (last, in [`wind_down`]).
    stop: ShutdownTrigger,
    /// Resolves once `stop` fired: what watches for the listener ends with it.
    stopped: Shutdown,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl HealthServer {
    fn start(listener: tokio::net::TcpListener) -> Self {
        // The components that register their own metrics exist before the registry is
        // shared.
        let stats = Arc::new(SchedulerStats::new());
        let facade_stats = Arc::new(FacadeStats::default());
        let jobs = Arc::new(JobMetrics::default());
        let state = Health::with_metrics(metrics::registry(&stats, &facade_stats, &jobs));
        let (stop, stopped) = shutdown_channel();
        let task = tokio::spawn(crate::health::serve(
            listener,
            state.clone(),
            stopped.clone(),
        ));
        HealthServer {
            state,
            stats,
            facade_stats,
            jobs,
            stop,
            stopped,
            task,
        }
    }

    /// Every backend's series exist from the start, at zero.
    fn init_backends<'a>(&self, backends: impl Iterator<Item = &'a Backend>) {
        for backend in backends {
            self.state.metrics.init_backend(*backend);
            self.jobs.init_backend(*backend);
        }
    }

    /// Every component runs: `/status` reports `observed`, `/readyz` says ready.
    fn ready(&self, observed: Observed) {
        self.state.status.set(Arc::new(observed));
        self.state.readiness.set(true);
    }

    /// Leading ended: not ready, not the leader, nothing observed.
    fn not_ready(&self) {
        self.state.readiness.set(false);
        self.state.metrics.leader.set(0);
        self.state.status.clear();
    }
}

/// What the leader's components are built from: the settings start-up left and what it
/// established, once the backends are adopted.
struct Components<'a> {
    prepared: &'a Prepared,
    health: &'a HealthServer,
    queue: &'a Queue,
    leadership: &'a Leadership,
    dispatch: &'a Arc<Dispatch>,
    capacities: &'a BTreeMap<Backend, usize>,
    finished: &'a FinishedAssignments,
    local: Option<&'a Arc<LocalIdentity>>,
    gitea: &'a GiteaSettings,
    /// The runner's declared capabilities.
    capabilities: &'a [String],
    /// The labels the runner declares (see [`Settings::declared_labels`]).
    labels: Vec<String>,
    nats: &'a NatsSettings,
    executors: &'a ExecutorTimings,
    policy: &'a DerivationPolicy,
    codec: &'a MetadataCodec,
    identity: &'a IdentitySource,
    state_dir: &'a Path,
    open_files: &'a crate::limits::OpenFiles,
    vm_terminal_grace: Option<Duration>,
}

/// Starts the scheduler and the facade (where this controller schedules) and every
/// backend's workers, then reports ready. Returns the components' tasks, and the facade's
/// listener where nothing serves it: it stays bound until the controller stops.
async fn spawn_components(
    c: Components<'_>,
    scheduler: Option<settings::SchedulerSettings>,
    facade_listener: tokio::net::TcpListener,
    extras: BTreeMap<Backend, Extras>,
    (scheduler_shutdown, work_shutdown): (&Shutdown, &Shutdown),
) -> Result<
    (
        JoinSet<(&'static str, Result<(), Source>)>,
        Option<tokio::net::TcpListener>,
    ),
    RuntimeError,
> {
    let mut tasks: JoinSet<(&'static str, Result<(), Source>)> = JoinSet::new();
    let facade_settings = scheduler.as_ref().map(|s| s.facade.clone());
    let facade_url = facade_url(facade_settings.as_ref(), &facade_listener)?;
    // Workers poke it when an assignment leaves the stream, so the backlog gate lets the
    // next fetch through at once.
    let backlog_changed = Arc::new(tokio::sync::Notify::new());
    let observations = Arc::new(Observations::new(Some(c.health.jobs.clone())));
    let shared = BackendWiring {
        dispatch: c.dispatch,
        gitea: &c.prepared.gitea,
        queue: c.queue,
        nats: c.nats,
        executors: c.executors,
        policy: c.policy,
        codec: c.codec,
        keyring: c.prepared.keyring.as_ref(),
        facade: facade_settings.as_ref(),
        facade_url: &facade_url,
        metrics: &c.health.jobs,
        observations: &observations,
        backlog_changed: &backlog_changed,
        vm_terminal_grace: c.vm_terminal_grace,
        leadership: c.leadership,
        envelope_id_key: &c.prepared.envelope_id_key,
    };
    let unserved = match scheduler {
        Some(scheduler) => {
            still_leading(c.leadership)?;
            let front = FrontWiring {
                shared: &shared,
                labels: c.labels,
                capabilities: c.capabilities.to_vec(),
                capacities: c.capacities,
                gitea_url: c.gitea.url.as_str(),
                extra_ca: c.prepared.extra_ca.as_deref(),
                finished: c.finished,
                stats: &c.health.stats,
                facade_stats: &c.health.facade_stats,
                identity: c.identity,
                local: c.local,
                state_dir: c.state_dir,
                open_files: c.open_files,
            };
            let shutdowns = (scheduler_shutdown, work_shutdown);
            spawn_front(&mut tasks, &scheduler, front, facade_listener, shutdowns).await?;
            None
        }
        None => Some(facade_listener),
    };
    let metrics = &c.health.state.metrics;
    let depth = spawn_workers(
        &mut tasks,
        &shared,
        c.capacities,
        extras,
        metrics,
        work_shutdown,
    )
    .await?;
    let backends = c.capacities.keys().copied().collect();
    let observed = Observed::new(c.dispatch.clone(), observations, depth, backends);
    c.health.ready(observed);
    Ok((tasks, unserved))
}

/// Invariant 4: stops fetching first (an in-flight fetch still publishes, bounded by the
/// scheduler's shutdown publish timeout), then the other components, then the health
/// listener, and gives the lease back.
async fn wind_down(
    mut tasks: JoinSet<(&'static str, Result<(), Source>)>,
    [scheduler, work, health]: [ShutdownTrigger; 3],
    elector: Option<ElectorTask>,
) {
    scheduler.trigger();
    work.trigger();
    let drain = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(DRAIN_TIMEOUT, drain).await.is_err() {
        tracing::warn!(timeout = ?DRAIN_TIMEOUT, "components did not stop in time");
    }
    health.trigger();
    if let Some(e) = elector {
        let _ = tokio::time::timeout(RELEASE_TIMEOUT, e).await;
    }
}

/// Waits until this replica leads (`true`) or `shutdown` comes first (`false`); stops the
/// health listener unless it leads.
async fn lead(
    leadership: &mut Leadership,
    shutdown: &Shutdown,
    stop_health: &ShutdownTrigger,
) -> Result<bool, RuntimeError> {
    tokio::select! {
        _ = shutdown.wait() => {
            stop_health.trigger();
            Ok(false)
        }
        acquired = leadership.acquired() => {
            if !acquired {
                stop_health.trigger();
                return Err(RuntimeError::LostLeadership);
            }
            tracing::info!("leading: starting every component");
            Ok(true)
        }
    }
}

/// Where executors reach the facade: `runner_facade_url`, or, on a single host without
/// it, the facade listener itself.
fn facade_url(
    facade: Option<&FacadeSettings>,
    listener: &tokio::net::TcpListener,
) -> Result<String, RuntimeError> {
    match facade.and_then(|f| f.url.clone()) {
        Some(url) => Ok(url),
        None => Ok(format!(
            "https://{}",
            listener
                .local_addr()
                .map_err(setup("reading the facade listener's address"))?
        )),
    }
}

/// Runs until `shutdown`, a lost lease or a component's end, whichever comes first.
async fn run_until_stopped(
    tasks: &mut JoinSet<(&'static str, Result<(), Source>)>,
    shutdown: &Shutdown,
    leadership: &mut Leadership,
) -> Result<(), RuntimeError> {
    tokio::select! {
        // A lost lease stops the scheduler at once (`stop_fetching_on_loss`): its end is
        // the loss, not a component failing.
        biased;
        _ = shutdown.wait() => Ok(()),
        _ = leadership.lost() => Err(RuntimeError::LostLeadership),
        Some(joined) = tasks.join_next() => Err(match joined {
            Ok((component, Err(source))) => RuntimeError::ComponentFailed { component, source },
            Ok((component, Ok(()))) => RuntimeError::Component(component),
            Err(e) => RuntimeError::ComponentFailed { component: "task", source: e.into() },
        }),
    }
}

/// The backends this leader drives, in a dispatch restored from what they hold (their
/// executors and the assignments those carry); their capacities and extra loops.
async fn adopt(
    pod: Option<BackendSettings<PodBackend>>,
    vm: Option<BackendSettings<VmBackend>>,
    wiring: &Wiring<'_>,
    capability_key: CapabilityKey,
    finished: &FinishedAssignments,
) -> Result<
    (
        Arc<Dispatch>,
        BTreeMap<Backend, usize>,
        BTreeMap<Backend, Extras>,
    ),
    RuntimeError,
> {
    let warm_claims: Arc<dyn gdr_core::executor::WarmClaims> = Arc::new(finished.warm_claims());
    let (backends, extras) = backends(pod, vm, wiring, warm_claims).await?;
    let capacities: BTreeMap<Backend, usize> =
        backends.iter().map(|(b, c)| (b.backend(), *c)).collect();
    let dispatch =
        Arc::new(Dispatch::new(backends, capability_key).with_finished(finished.clone()));
    restore(&dispatch, &capacities).await?;
    Ok((dispatch, capacities, extras))
}

/// The capability key, the key authenticating envelope IDs where the task key is missing
/// (21), derived from it, and the task keyring (`None`: plaintext envelopes).
fn keys(
    capability_key_file: &KeyFile,
    task_keys: Option<&TaskKeyFiles>,
    state_dir: &Path,
    (single_host, writes_envelopes): (bool, bool),
    secrets: SecretPermissions,
) -> Result<(CapabilityKey, EnvelopeIdKey, Option<TaskKeyring>), RuntimeError> {
    let capability = capability_key(capability_key_file, secrets)?;
    let envelope_id = capability.envelope_id_key();
    let ring = keyring(task_keys, state_dir, single_host, writes_envelopes, secrets)?;
    Ok((capability, envelope_id, ring))
}

/// The compatibility settings that weaken a guarantee, each named in a warning at start.
fn warn_about_compatibility(nats: &NatsSettings, policy: &DerivationPolicy, keyed: bool) {
    if keyed && nats.security.accept_plaintext_envelopes {
        tracing::warn!(
            "accept_plaintext_envelopes = true: plaintext (v1) assignments are trusted although a task key is configured; anyone able to publish to the queue can start a job with any repository's identity. Turn it off once the queue the Go version wrote is drained"
        );
    }
    if policy.scheme == gdr_core::identity::IdentityScheme::Job {
        tracing::warn!(
            "spiffe_id_scheme = \"job\": job SPIFFE IDs do not name the ref, so a pull request's or any branch's job can have the identity of any job key of its repository. Switch to \"ref\" once the queue, executors and SPIRE entries of the Go version are gone"
        );
    }
    if nats.security.accept_undated_envelopes {
        tracing::warn!(
            "accept_undated_envelopes = true: sealed assignments without a fetch time (written by an older release) are run although their age cannot be checked, so a copy can be replayed once its finished record expired. Turn it off once the queue the older release wrote is drained"
        );
    }
}

// === credentials ===

/// Raises the open-file limit to its hard limit and logs both (invariant 21: a few hundred
/// idle connections exhaust the usual soft limit of 1024).
fn open_files() -> crate::limits::OpenFiles {
    match crate::limits::raise_open_files() {
        Ok(limits) => {
            tracing::info!(
                before = ?limits.before,
                now = ?limits.now,
                hard = ?limits.hard,
                "open-file limit (RLIMIT_NOFILE; None is unlimited)"
            );
            limits
        }
        Err(e) => {
            let current = rustix::process::getrlimit(rustix::process::Resource::Nofile);
            tracing::warn!(error = %e, soft = ?current.current, hard = ?current.maximum, "cannot raise the open-file limit; keeping it");
            crate::limits::OpenFiles {
                before: current.current,
                now: current.current,
                hard: current.maximum,
            }
        }
    }
}

/// The facade's connection limit, capped to its share of the open-file limit.
fn facade_limits(mut limits: FacadeLimits, open_files: &crate::limits::OpenFiles) -> FacadeLimits {
    let share =
        usize::try_from(open_files.soft() / FACADE_SHARE_OF_OPEN_FILES).unwrap_or(usize::MAX);
    if limits.max_connections > share {
        tracing::warn!(
            configured = limits.max_connections,
            used = share,
            open_files = open_files.soft(),
            "runner_facade_max_connections is above a quarter of the open-file limit; using that"
        );
        limits.max_connections = share.max(1);
    }
    tracing::info!(
        max_connections = limits.max_connections,
        per_peer = limits.max_connections_per_peer,
        per_identity = limits.max_connections_per_identity,
        per_assignment = limits.max_connections_per_assignment,
        "facade connection limits"
    );
    limits
}

/// The FetchTask pollers: one per slot, at least one, at most `fetch_pollers_max` (Gitea
/// serialises task picks per instance, `MAX_CONCURRENT_TASK_PICKS`, so more pollers only
/// add load on Gitea).
pub fn pollers(capacities: &BTreeMap<Backend, usize>, max: usize) -> usize {
    capacities.values().sum::<usize>().clamp(1, max.max(1))
}

/// Whether anything of this configuration keeps state under `state_dir`.
fn uses_state_dir(
    nats: &NatsSettings,
    identity: &IdentitySource,
    pod: Option<&BackendSettings<PodBackend>>,
    vm: Option<&BackendSettings<VmBackend>>,
) -> bool {
    matches!(nats.server, NatsServer::Embedded { .. })
        || matches!(identity, IdentitySource::Local)
        || pod.is_some_and(|p| matches!(p.kind, PodBackend::Process(_)))
        || vm.is_some_and(|v| matches!(v.kind, VmBackend::Process(_)))
}

/// Why a state directory could not be made private.
#[derive(Debug, thiserror::Error)]
pub enum PrivateDirError {
    /// It could not be created.
    #[error("creating {}: {source}", .path.display())]
    Create {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Its mode could not be read.
    #[error("reading {}: {source}", .path.display())]
    Read {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It is open to others and could not be restricted.
    #[error("{} is mode {mode:04o} and cannot be made 0700: {source}", .path.display())]
    Restrict {
        /// The directory.
        path: PathBuf,
        /// Its mode.
        mode: u32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Creates `dir` (and its parents) as 0700, or makes an existing one 0700: the embedded
/// NATS store, the local CA's key and the executors' Workload API sockets live below it,
/// and only the controller's user may reach them.
pub(crate) fn private_dir(dir: &Path) -> Result<(), PrivateDirError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let path = || dir.to_path_buf();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| PrivateDirError::Create {
            path: path(),
            source,
        })?;
    let mode = std::fs::metadata(dir)
        .map_err(|source| PrivateDirError::Read {
            path: path(),
            source,
        })?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(
            |source| PrivateDirError::Restrict {
                path: path(),
                mode: mode & 0o7777,
                source,
            },
        )?;
        tracing::info!(dir = %dir.display(), was = format!("{:04o}", mode & 0o7777), "restricted a state directory to its owner (0700)");
    }
    Ok(())
}

/// Reads the UUID and token files written by `register`, refusing files whose mode
/// `permissions` does not allow.
fn credentials_from_files(
    uuid_file: &Path,
    token_file: &Path,
    permissions: SecretPermissions,
) -> Result<Credentials, crate::settings::SecretFileError> {
    use crate::settings::read_secret_file_with as read;
    Ok(Credentials::new(
        read("gitea_runner_uuid_file", uuid_file, permissions)?,
        read("gitea_runner_token_file", token_file, permissions)?,
    ))
}

fn gitea_client(
    gitea: &GiteaSettings,
    secrets: SecretPermissions,
) -> Result<(GiteaClient, Option<Vec<u8>>), RuntimeError> {
    let credentials = credentials_from_files(&gitea.uuid_file, &gitea.token_file, secrets)
        .map_err(setup("reading the runner credentials"))?;
    let extra_ca = match &gitea.ca_file {
        Some(p) => Some(std::fs::read(p).map_err(|e| {
            step("gitea_ca_file")(in_context(format_args!("cannot read {}", p.display()), e))
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

fn capability_key(
    file: &KeyFile,
    secrets: SecretPermissions,
) -> Result<CapabilityKey, RuntimeError> {
    let text = first_start::capability_key_text(file, |path| {
        read_secret_file_with("runner_facade_capability_key_file", path, secrets)
    })
    .map_err(step("reading the capability key"))?;
    CapabilityKey::new(text.as_bytes()).map_err(|e| {
        step("runner_facade_capability_key_file")(in_context(file.path().display(), e))
    })
}

/// The task key single-host mode generates under `state_dir` when no
/// `task_encryption_key_file` is configured, so job secrets never sit readable in the
/// embedded store.
pub const GENERATED_TASK_KEY_FILE: &str = "task-encryption.key";

/// The task keys: the configured ones; in single-host mode without one, a key generated
/// under `state_dir` on first start (mode 0600; also kept for opening older envelopes once
/// a key is configured). A scheduler that would write plaintext v1 envelopes says so.
fn keyring(
    files: Option<&TaskKeyFiles>,
    state_dir: &Path,
    single_host: bool,
    writes_envelopes: bool,
    secrets: SecretPermissions,
) -> Result<Option<TaskKeyring>, RuntimeError> {
    let generated = state_dir.join(GENERATED_TASK_KEY_FILE);
    let Some(TaskKeyFiles { current, previous }) = files else {
        if single_host {
            return Ok(Some(TaskKeyring::new(
                generated_task_key(&generated)?,
                Vec::new(),
            )));
        }
        if writes_envelopes {
            tracing::warn!(
                "task_encryption_key_file is not set: assignments are published as plaintext v1 envelopes and job secrets are readable by anyone who can read the stream; configure a key (envelope v2)"
            );
        }
        return Ok(None);
    };
    let load = |path: &PathBuf| -> Result<TaskKey, RuntimeError> {
        check_secret_file_mode("task_encryption_key_file", path, secrets)
            .map_err(setup("task_encryption_key_file"))?;
        let bytes = std::fs::read(path).map_err(|e| {
            step("task_encryption_key_file")(in_context(
                format_args!("cannot read {}", path.display()),
                e,
            ))
        })?;
        TaskKey::from_file_contents(&bytes)
            .map_err(|e| step("task_encryption_key_file")(in_context(path.display(), e)))
    };
    let mut previous = previous.iter().map(load).collect::<Result<Vec<_>, _>>()?;
    if single_host && generated.exists() {
        // Envelopes sealed before a key was configured still open.
        previous.push(load(&generated)?);
    }
    Ok(Some(TaskKeyring::new(load(current)?, previous)))
}

/// Reads the generated key at `path`, or creates it (0600) on first start.
fn generated_task_key(path: &Path) -> Result<TaskKey, RuntimeError> {
    let fail = |e: Source| step("generating the task encryption key")(e);
    let (text, created) = first_start::generated_secret(path, || {
        TaskKey::generate()
            .map(|(_, text)| text)
            .map_err(std::io::Error::other)
    })
    .map_err(|e| fail(e.into()))?;
    let key = TaskKey::from_file_contents(text.as_bytes())
        .map_err(|e| fail(in_context(path.display(), e)))?;
    if created {
        tracing::info!(path = %path.display(), key_id = key.key_id(), "generated the task encryption key of single-host mode");
    }
    Ok(key)
}

// === leadership ===

/// The host (Pod) name: `$HOSTNAME`, else the kernel's (a systemd service has no
/// `HOSTNAME` in its environment).
fn host_name() -> Option<String> {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
}

/// `<host>-<8 random hex digits>`, drawn once per process: two processes on one host, or a
/// restarted container of the same Pod, never campaign under one identity (two holders of
/// one identity would both lead).
fn default_identity(host: Option<String>) -> Option<String> {
    host.map(|h| format!("{h}-{:08x}", rand::random::<u32>()))
}

/// Stops the scheduler (no new FetchTask, no heartbeat) the moment leadership is lost,
/// wherever the rest of the controller is, even still starting; ends once the scheduler is
/// stopped anyway.
/// The scheduler's own shutdown, triggered at once when the lease is lost (invariant 18:
/// a deposed leader fetches nothing more, even while it still starts).
fn scheduler_stop(leadership: &Leadership) -> (ShutdownTrigger, Shutdown) {
    let (stop, shutdown) = shutdown_channel();
    tokio::spawn(stop_fetching_on_loss(
        leadership.clone(),
        stop.clone(),
        shutdown.clone(),
    ));
    (stop, shutdown)
}

async fn stop_fetching_on_loss(
    mut leadership: Leadership,
    stop: ShutdownTrigger,
    stopped: Shutdown,
) {
    tokio::select! {
        () = leadership.lost() => {
            tracing::warn!("lost the leader lease: fetching stopped before anything else");
            stop.trigger();
        }
        () = stopped.wait() => {}
    }
}

/// Invariant 18: a replica that lost the Lease while it was still starting starts nothing
/// more; the check runs before every component is spawned.
fn still_leading(leadership: &Leadership) -> Result<(), RuntimeError> {
    if leadership.is_leader() {
        Ok(())
    } else {
        tracing::warn!("lost the leader lease while starting: starting nothing more");
        Err(RuntimeError::LostLeadership)
    }
}

/// Runs a start-up step that may wait long (an SVID not yet issued) unless leadership is
/// lost first, so a deposed leader neither waits for it nor goes on starting (18).
async fn while_leading<T>(
    leadership: &Leadership,
    step: impl std::future::Future<Output = Result<T, RuntimeError>>,
) -> Result<T, RuntimeError> {
    let mut watch = leadership.clone();
    tokio::select! {
        biased;
        () = watch.lost() => {
            tracing::warn!("lost the leader lease while starting: starting nothing more");
            Err(RuntimeError::LostLeadership)
        }
        done = step => done,
    }
}

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
    let identity = match identity {
        // The operator's choice; the elector still refuses to lead beside a duplicate.
        Some(configured) => configured,
        None => default_identity(host_name()).ok_or_else(|| {
            step("leader election")(
                "leader_identity is required for leader election where the host name is unknown (no HOSTNAME, no /proc/sys/kernel/hostname)".into(),
            )
        })?,
    };
    tracing::info!(identity = %identity, "campaigning for the leader lease");
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
            let dir = state_dir.join("ca");
            private_dir(&dir).map_err(|e| step("loading the local CA")(e.into()))?;
            let ca = LocalCa::load_or_create(&dir, policy.trust_domain.as_str())
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

// === components ===

/// What the scheduler and the facade are built from, besides their settings.
struct FrontWiring<'a> {
    /// What the workers are built from too (Gitea, the queue, the policy, the keys, the
    /// dispatch, the job metrics, the backlog's signal, the leadership).
    shared: &'a BackendWiring<'a>,
    labels: Vec<String>,
    capabilities: Vec<String>,
    capacities: &'a BTreeMap<Backend, usize>,
    gitea_url: &'a str,
    extra_ca: Option<&'a [u8]>,
    finished: &'a FinishedAssignments,
    stats: &'a Arc<SchedulerStats>,
    facade_stats: &'a Arc<FacadeStats>,
    identity: &'a IdentitySource,
    local: Option<&'a Arc<LocalIdentity>>,
    state_dir: &'a Path,
    open_files: &'a crate::limits::OpenFiles,
}

/// Starts the scheduler (pollers, heartbeater) and the facade on `listener`, once the
/// facade has its SVID; the scheduler stops on the first shutdown, the facade on the
/// second.
async fn spawn_front(
    tasks: &mut JoinSet<(&'static str, Result<(), Source>)>,
    scheduler: &settings::SchedulerSettings,
    w: FrontWiring<'_>,
    listener: tokio::net::TcpListener,
    (scheduler_shutdown, work_shutdown): (&Shutdown, &Shutdown),
) -> Result<(), RuntimeError> {
    let shared = w.shared;
    let channels = w
        .capacities
        .keys()
        .map(|backend| (*backend, executor_channel(shared, *backend)))
        .collect();
    let standbys = BackendStandbys::new(shared.dispatch.clone(), channels);
    let facade = Arc::new(
        Facade::new(
            shared.dispatch.clone(),
            shared.gitea.clone(),
            None,
            shared.policy.labels.clone(),
        )
        .with_metrics(shared.metrics.clone())
        .with_standbys(Arc::new(standbys)),
    );
    let wiring = SchedulerWiring {
        settings: scheduler,
        labels: w.labels,
        capabilities: w.capabilities,
        pollers: pollers(w.capacities, scheduler.fetch_pollers_max),
        capacities: w.capacities,
        backlog_changed: shared.backlog_changed,
        gitea: shared.gitea,
        queue: shared.queue,
        policy: shared.policy,
        keyring: shared.keyring,
        envelope_id_key: shared.envelope_id_key,
        finished: w.finished,
        held_timeout: shared.nats.security.held_timeout,
        stats: w.stats,
        facade: &facade,
    };
    spawn_scheduler(tasks, wiring, scheduler_shutdown);
    let endpoint = facade_endpoint(
        w.identity,
        w.local,
        w.state_dir,
        &scheduler.facade.spiffe_id,
    )
    .await?;
    let wiring = FacadeWiring {
        endpoint: &endpoint,
        trust_domain: shared.policy.trust_domain.as_str(),
        gitea_url: w.gitea_url,
        extra_ca: w.extra_ca,
        limits: facade_limits(scheduler.facade.limits, w.open_files),
        stats: w.facade_stats.clone(),
    };
    // Its SVID may be long in coming: a loss meanwhile ends the start (18).
    while_leading(
        shared.leadership,
        spawn_facade(tasks, facade, listener, wiring, work_shutdown.clone()),
    )
    .await
}

struct SchedulerWiring<'a> {
    settings: &'a settings::SchedulerSettings,
    labels: Vec<String>,
    capabilities: Vec<String>,
    pollers: usize,
    capacities: &'a BTreeMap<Backend, usize>,
    backlog_changed: &'a Arc<tokio::sync::Notify>,
    gitea: &'a GiteaClient,
    queue: &'a Queue,
    policy: &'a DerivationPolicy,
    keyring: Option<&'a TaskKeyring>,
    envelope_id_key: &'a EnvelopeIdKey,
    finished: &'a FinishedAssignments,
    held_timeout: Duration,
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
        w.settings.backlog_limit.unwrap_or(1),
    );
    // Each backend's own backlog: the configured limit, else its capacity.
    poller_settings.backlog_limits = w
        .capacities
        .iter()
        .map(|(b, c)| {
            let capacity = u64::try_from(*c).unwrap_or(u64::MAX);
            (*b, w.settings.backlog_limit.unwrap_or(capacity).max(1))
        })
        .collect();
    poller_settings.shutdown_publish_timeout = SHUTDOWN_PUBLISH_TIMEOUT;
    poller_settings.idle_interval = w.settings.fetch_interval;
    let mut scheduler = Scheduler::new(
        w.gitea.clone(),
        w.queue.producer.clone(),
        w.queue.stream.clone(),
        w.policy.clone(),
        poller_settings,
    )
    .with_stats(w.stats.clone())
    .with_backlog_signal(w.backlog_changed.clone())
    .with_envelope_id_key(w.envelope_id_key.clone());
    let fetched = scheduler.fetched_tasks();
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
    .with_stats(w.stats.clone())
    .with_fetched_tasks(fetched)
    .with_finished(w.finished.clone())
    .with_held(w.envelope_id_key.clone(), w.held_timeout);
    let stop = shutdown.clone();
    tasks.spawn(async move {
        heartbeater.run(stop).await;
        ("heartbeater", Ok(()))
    });
}

/// What a backend's worker and lifecycle reconciler are built from, besides the backend.
struct BackendWiring<'a> {
    dispatch: &'a Arc<Dispatch>,
    gitea: &'a GiteaClient,
    queue: &'a Queue,
    nats: &'a NatsSettings,
    executors: &'a ExecutorTimings,
    policy: &'a DerivationPolicy,
    codec: &'a MetadataCodec,
    keyring: Option<&'a TaskKeyring>,
    facade: Option<&'a FacadeSettings>,
    facade_url: &'a str,
    metrics: &'a Arc<JobMetrics>,
    observations: &'a Arc<Observations>,
    backlog_changed: &'a Arc<tokio::sync::Notify>,
    vm_terminal_grace: Option<Duration>,
    leadership: &'a Leadership,
    envelope_id_key: &'a EnvelopeIdKey,
}

/// Starts every backend's worker and lifecycle reconciler, the held assignments'
/// reconciler, and the sampler of the pools' and queues' gauges; returns where the queue
/// depths are read (`None` while the stream cannot be opened).
async fn spawn_workers(
    tasks: &mut JoinSet<(&'static str, Result<(), Source>)>,
    w: &BackendWiring<'_>,
    capacities: &BTreeMap<Backend, usize>,
    mut extras: BTreeMap<Backend, Extras>,
    metrics: &Arc<Metrics>,
    shutdown: &Shutdown,
) -> Result<Option<Arc<dyn QueueDepth>>, RuntimeError> {
    for (backend, capacity) in capacities {
        let Some(adapter) = w.dispatch.backend(*backend) else {
            continue;
        };
        let extras = extras.remove(backend).unwrap_or_default();
        still_leading(w.leadership)?;
        spawn_backend(tasks, w, (*backend, *capacity), adapter, extras, shutdown).await?;
    }
    let depth = queue_depth(w.queue).await;
    if !capacities.is_empty() {
        still_leading(w.leadership)?;
        let held = HeldWiring {
            queue: w.queue,
            nats: w.nats,
            policy: w.policy,
            keyring: w.keyring,
            envelope_id_key: w.envelope_id_key,
            gitea: w.gitea,
            dispatch: w.dispatch,
            metrics: w.metrics,
        };
        spawn_held(tasks, held, shutdown.clone()).await?;
    }
    tasks.spawn(sample_gauges(
        metrics.clone(),
        w.dispatch.clone(),
        capacities.clone(),
        depth.clone(),
        shutdown.clone(),
    ));
    Ok(depth)
}

/// What a fresh executor of `backend` is told about its facade and its runner: by the
/// worker, in every executor it creates, and by the facade, to a warm executor whose
/// sandbox a job claimed.
fn executor_channel(w: &BackendWiring<'_>, backend: Backend) -> ExecutorChannel {
    let facade = w.facade;
    ExecutorChannel {
        facade_url: facade.map(|_| w.facade_url.to_owned()).unwrap_or_default(),
        facade_spiffe_id: facade.map(|f| f.spiffe_id.clone()).unwrap_or_default(),
        runner_label: w.policy.labels.label_of(backend).to_owned(),
        report_outage_tolerance: w.executors.report_outage_tolerance,
    }
}

/// Starts one backend's worker (its JetStream consumer) and lifecycle reconciler.
async fn spawn_backend(
    tasks: &mut JoinSet<(&'static str, Result<(), Source>)>,
    w: &BackendWiring<'_>,
    (backend, capacity): (Backend, usize),
    adapter: Arc<dyn ExecutorBackend>,
    extras: Extras,
    shutdown: &Shutdown,
) -> Result<(), RuntimeError> {
    let Extras {
        wake,
        housekeeping,
        resync,
    } = extras;
    let settings = WorkerSettings {
        backend,
        full_delay: FULL_DELAY,
        not_ready_delay: NOT_READY_DELAY,
        error_delay: ERROR_DELAY,
        progress_interval: w.nats.ack_wait / 3,
        start_deadline: w.executors.start_deadline,
        channel: executor_channel(w, backend),
        codec: w.codec.clone(),
        envelopes: EnvelopeTrust {
            accept_plaintext: w.nats.security.accept_plaintext_envelopes,
            max_age: w.nats.security.task_lifetime,
            accept_undated: w.nats.security.accept_undated_envelopes,
        },
        held_subject: w.queue.stream.held_subject(backend),
    };
    // What the worker gives every executor, for the warm ones started before any job.
    let standby_environment = settings.standby_environment();
    let consumer = w
        .queue
        .consumer(backend, capacity, w.nats.ack_wait, w.nats.create_stream)
        .await?;
    let worker = Worker::new(
        w.dispatch.clone(),
        w.gitea.clone(),
        w.policy.clone(),
        w.keyring.cloned(),
        settings,
    )
    .map_err(setup("starting a worker"))?
    .with_outcomes(count_outcomes(w.metrics, backend))
    .with_metrics(w.metrics.clone())
    .with_wake(wake.clone())
    .with_backlog_signal(w.backlog_changed.clone());
    // Creating the consumer may have waited: a deposed leader must not re-offer adopted
    // executors' assignments nor consume (invariant 18).
    still_leading(w.leadership)?;
    w.queue.resume_adopted(&worker, backend).await;
    still_leading(w.leadership)?;
    let stop = shutdown.clone();
    tasks.spawn(async move {
        worker.run(consumer, stop).await;
        ("worker", Ok(()))
    });
    let mut lifecycle = Lifecycle::new(
        w.dispatch.clone(),
        adapter,
        w.gitea.clone(),
        w.executors.idle_timeout,
    )
    .with_metrics(w.metrics.clone())
    .with_observations(w.observations.clone())
    .with_wake(wake)
    .with_unstarted(
        w.executors.start_deadline,
        Arc::new(
            queue::StreamQueue::new(w.queue.worker.clone(), w.queue.stream.clone(), backend)
                // Envelopes carry an authenticated ID where a task key seals them.
                .authenticated_by(
                    w.envelope_id_key.clone(),
                    w.keyring.is_none() || w.nats.security.accept_plaintext_envelopes,
                ),
        ),
    );
    if let Some(h) = housekeeping {
        h.standby_environment(standby_environment);
        lifecycle = lifecycle.with_housekeeping(h);
    }
    if let (Backend::Vm, Some(grace)) = (backend, w.vm_terminal_grace) {
        lifecycle = lifecycle.with_terminal_grace(grace);
    }
    let stop = shutdown.clone();
    tasks.spawn(async move {
        lifecycle.run(resync, stop).await;
        ("lifecycle", Ok(()))
    });
    Ok(())
}

struct FacadeWiring<'a> {
    endpoint: &'a str,
    trust_domain: &'a str,
    gitea_url: &'a str,
    extra_ca: Option<&'a [u8]>,
    limits: FacadeLimits,
    stats: Arc<FacadeStats>,
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
    let (limits, stats) = (w.limits, w.stats);
    tasks.spawn(async move {
        // The source must live as long as the server: it rotates the SVID.
        let _source = source;
        let result = facade
            .serve_limited(listener, tls, proxy, limits, stats, shutdown)
            .await;
        ("facade", result.map_err(Source::from))
    });
    Ok(())
}

struct HeldWiring<'a> {
    queue: &'a Queue,
    nats: &'a NatsSettings,
    policy: &'a DerivationPolicy,
    keyring: Option<&'a TaskKeyring>,
    envelope_id_key: &'a EnvelopeIdKey,
    gitea: &'a GiteaClient,
    dispatch: &'a Arc<Dispatch>,
    metrics: &'a Arc<JobMetrics>,
}

/// The reconciler of assignments sealed with a task key this controller lacks.
async fn spawn_held(
    tasks: &mut JoinSet<(&'static str, Result<(), Source>)>,
    w: HeldWiring<'_>,
    shutdown: Shutdown,
) -> Result<(), RuntimeError> {
    let held = HeldAssignments::new(
        w.queue.worker.clone(),
        w.queue.stream.clone(),
        w.policy.clone(),
        w.keyring.cloned(),
        w.gitea.clone(),
        w.dispatch.clone(),
        w.nats.security.held_timeout,
    )
    .with_envelope_id_key(w.envelope_id_key.clone())
    .with_task_lifetime(w.nats.security.task_lifetime);
    let consumer = match held.consumer(w.nats.create_stream, w.nats.ack_wait).await {
        Ok(c) => c,
        // Operator-provisioned queues may lack it: held assignments then wait in the
        // stream (NAKed by the workers) as before.
        Err(e) if !w.nats.create_stream => {
            tracing::warn!(error = %e, "no held-assignments consumer; assignments sealed with an unknown task key are only retried");
            return Ok(());
        }
        Err(e) => return Err(setup("creating the held-assignments consumer")(e)),
    };
    let metrics = w.metrics.clone();
    tasks.spawn(async move {
        held.run(consumer, HELD_INTERVAL, shutdown, Some(metrics))
            .await;
        ("held assignments", Ok(()))
    });
    Ok(())
}

fn count_outcomes(
    metrics: &Arc<JobMetrics>,
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

/// Samples the observed state the gauges show (the pools' slots and the queue depths)
/// every second; counters are updated where their events happen.
async fn sample_gauges(
    metrics: Arc<Metrics>,
    dispatch: Arc<Dispatch>,
    capacities: BTreeMap<Backend, usize>,
    depth: Option<Arc<dyn QueueDepth>>,
    stop: Shutdown,
) -> (&'static str, Result<(), Source>) {
    loop {
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
            if let Some(depth) = &depth {
                // Left at its last value while JetStream does not answer.
                if let Ok(Ok(n)) =
                    tokio::time::timeout(METRICS_INTERVAL, depth.unclaimed(*backend)).await
                {
                    metrics
                        .queue_depth
                        .get_or_create(&label)
                        .set(i64::try_from(n).unwrap_or(i64::MAX));
                }
            }
        }
        if !stop.sleep(METRICS_INTERVAL).await {
            return ("metrics", Ok(()));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// DESIGN invariant 5 (issue 9): single-host mode without a configured key generates
    /// one under `state_dir` (mode 0600) on first start and reuses it, so the scheduler seals
    /// envelope v2; once a key is configured the generated one still opens older envelopes.
    /// With an external NATS and no key there is no keyring: plaintext v1, warned about.
    #[test]
    fn single_host_mode_generates_its_task_key_once_and_keeps_it_for_older_envelopes() {
        let state = tempfile::tempdir().unwrap();
        let first = keyring(None, state.path(), true, true, SecretPermissions::default())
            .unwrap()
            .unwrap();
        let file = state.path().join(GENERATED_TASK_KEY_FILE);
        let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let again = keyring(None, state.path(), true, true, SecretPermissions::default())
            .unwrap()
            .unwrap();
        assert_eq!(again.current.key_id(), first.current.key_id(), "reused");

        let configured = state.path().join("configured.key");
        std::fs::write(&configured, "ab".repeat(32)).unwrap();
        std::fs::set_permissions(&configured, std::fs::Permissions::from_mode(0o600)).unwrap();
        let files = TaskKeyFiles {
            current: configured.clone(),
            previous: Vec::new(),
        };
        let rotated = keyring(
            Some(&files),
            state.path(),
            true,
            true,
            SecretPermissions::default(),
        )
        .unwrap()
        .unwrap();
        assert_ne!(rotated.current.key_id(), first.current.key_id());
        assert!(
            rotated
                .previous
                .iter()
                .any(|k| k.key_id() == first.current.key_id()),
            "envelopes sealed with the generated key still open"
        );

        let cluster = tempfile::tempdir().unwrap();
        assert!(
            keyring(
                None,
                cluster.path(),
                false,
                true,
                SecretPermissions::default()
            )
            .unwrap()
            .is_none()
        );
        assert!(!cluster.path().join(GENERATED_TASK_KEY_FILE).exists());
    }
}
