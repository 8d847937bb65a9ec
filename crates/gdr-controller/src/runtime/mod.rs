//! Wiring of the `controller` subcommand: configuration → adapters → components.
//!
//! The leader runs everything (pollers, heartbeats, facade, workers, lifecycle
//! reconcilers); a standby only campaigns and answers not-ready (invariant 18). Losing
//! the lease or a shutdown stops new fetches, lets in-flight work finish within bounds
//! (invariant 4) and returns; a lost lease is an error so the process exits non-zero.

mod embedded_nats;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use tokio::sync::watch;

use crate::config::{Component, Config, read_secret_file};
use crate::dispatch::Dispatch;
use crate::facade::Facade;
use crate::facade::proxy::ReverseProxy;
use crate::gitea::{ClientOptions, Credentials, GiteaClient};
use crate::lease::{LeaderElector, Leadership, LeaseSettings};
use crate::lifecycle::Lifecycle;
use crate::metrics::{BackendLabel, Metrics, OutcomeLabels, Readiness};
use crate::queue::{self, ConsumerSettings, StreamSettings};
use crate::scheduler::{
    Heartbeater, Scheduler, SchedulerSettings, SchedulerStats, shutdown_channel,
};
use crate::worker::{Worker, WorkerSettings};
use gdr_backends::process::{ProcessBackend, ProcessBackendSettings};
use gdr_core::assignment::{DerivationPolicy, TaskKey, TaskKeyring};
use gdr_core::backend::{Backend, BackendLabels};
use gdr_core::capability::CapabilityKey;
use gdr_core::executor::ExecutorBackend;
use gdr_core::identity::TrustDomain;
use gdr_identity::workload_api::{LocalCa, LocalIdentity};

pub use embedded_nats::EmbeddedNats;

/// Sockets the caller bound (so nothing below `main` picks a port).
pub struct Listeners {
    /// The facade (SPIFFE mTLS).
    pub facade: tokio::net::TcpListener,
    /// `/healthz`, `/readyz`, `/metrics`.
    pub health: tokio::net::TcpListener,
}

/// Why the controller stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// Configuration or secrets are unusable.
    #[error("{0}")]
    Setup(String),
    /// This replica lost the leader lease: it stopped working and must exit.
    #[error("lost the leader lease")]
    LostLeadership,
    /// A component failed.
    #[error("{component}: {message}")]
    Component {
        /// Which component.
        component: &'static str,
        /// What happened.
        message: String,
    },
}

fn setup(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Setup(e.to_string())
}

/// Test hooks: what the runtime exposes of itself while running.
#[derive(Clone, Default)]
pub struct Handles {
    /// Set once the dispatch exists.
    pub dispatch: Arc<std::sync::OnceLock<Arc<Dispatch>>>,
    /// Set once the readiness exists.
    pub readiness: Arc<std::sync::OnceLock<Arc<Readiness>>>,
    /// Kubernetes client for leader election (default: in-cluster or kubeconfig).
    pub kube: Option<kube::Client>,
}

/// Runs the controller until `shutdown` resolves (Ok) or leadership is lost (Err).
pub async fn run(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
    handles: Handles,
) -> Result<(), RuntimeError> {
    let trust_domain =
        TrustDomain::new(config.trust_domain.clone().unwrap_or_default()).map_err(setup)?;
    let policy = DerivationPolicy {
        trust_domain: trust_domain.clone(),
        labels: BackendLabels::new(config.vm_runner_label.clone()).map_err(setup)?,
    };
    let (uuid_file, token_file) = match (
        &config.gitea_runner_uuid_file,
        &config.gitea_runner_token_file,
    ) {
        (Some(u), Some(t)) => (u.clone(), t.clone()),
        _ => {
            return Err(setup(
                "gitea_runner_uuid_file and gitea_runner_token_file are required",
            ));
        }
    };
    let credentials = Credentials::from_files(&uuid_file, &token_file).map_err(setup)?;
    let capability_key = {
        let path = config
            .runner_facade_capability_key_file
            .as_ref()
            .ok_or_else(|| setup("runner_facade_capability_key_file is required"))?;
        let text = read_secret_file("runner_facade_capability_key_file", path).map_err(setup)?;
        CapabilityKey::new(text.as_bytes()).map_err(|e| {
            setup(format!(
                "runner_facade_capability_key_file ({}): {e}",
                path.display()
            ))
        })?
    };
    let keyring = load_keyring(&config)?;
    let gitea_url = config
        .gitea_instance_url
        .clone()
        .ok_or_else(|| setup("gitea_instance_url is required"))?;
    let extra_ca = match &config.gitea_ca_file {
        Some(p) => Some(
            std::fs::read(p).map_err(|e| setup(format!("gitea_ca_file ({}): {e}", p.display())))?,
        ),
        None => None,
    };
    let mut options = ClientOptions::new(gitea_url.clone());
    options.extra_ca_pem = extra_ca.clone();
    options.request_timeout = config.gitea_request_timeout;
    options.fetch_timeout = config.gitea_fetch_timeout;
    let gitea = GiteaClient::new(options, Some(&credentials)).map_err(setup)?;

    let metrics = Arc::new(Metrics::new());
    let readiness = Arc::new(Readiness::default());
    let _ = handles.readiness.set(readiness.clone());
    let (stop_all, stop_all_rx) = watch::channel(false);
    let health = {
        let mut stop = stop_all_rx.clone();
        tokio::spawn(crate::metrics::serve(
            listeners.health,
            metrics.clone(),
            readiness.clone(),
            async move {
                let _ = stop.wait_for(|s| *s).await;
            },
        ))
    };

    // NATS: the configured cluster, or the embedded single-host server.
    let mut embedded = None;
    let nats_url = match &config.nats_url {
        Some(url) => url.clone(),
        None => {
            let server =
                EmbeddedNats::start(&config.nats_server_binary, &config.state_dir.join("nats"))
                    .await
                    .map_err(setup)?;
            let url = server.url();
            embedded = Some(server);
            url
        }
    };
    let producer = connect_nats(&config, &nats_url, Role::Producer).await?;
    let consumer_conn = connect_nats(&config, &nats_url, Role::Worker).await?;
    let js_producer = jetstream::new(producer);
    let js_worker = jetstream::new(consumer_conn);
    let stream_settings = StreamSettings {
        stream: config.nats_stream.clone(),
        subject_base: config.nats_subject_base.clone(),
        duplicate_window: Duration::from_secs(120),
    };
    let _stream = if config.nats_create_stream {
        queue::ensure_stream(&js_producer, &stream_settings)
            .await
            .map_err(setup)?
    } else {
        queue::open_stream(&js_producer, &stream_settings)
            .await
            .map_err(setup)?
    };

    // Leadership.
    let (leader_tx, mut leadership) = if config.leader_election {
        let (tx, rx) = Leadership::channel();
        (Some(tx), rx)
    } else {
        (None, Leadership::always())
    };
    let elector = match leader_tx {
        Some(tx) => {
            let client = crate::lease::client_from_environment()
                .await
                .map_err(setup)?;
            let identity = config
                .leader_identity
                .clone()
                .or_else(|| std::env::var("HOSTNAME").ok())
                .ok_or_else(|| {
                    setup("leader_identity (or HOSTNAME) is required for leader election")
                })?;
            let settings = LeaseSettings::new(
                config.lease_namespace.clone(),
                config.lease_name.clone(),
                identity,
            );
            let mut stop = stop_all_rx.clone();
            Some(tokio::spawn(LeaderElector::new(client, settings).run(
                tx,
                async move {
                    let _ = stop.wait_for(|s| *s).await;
                },
            )))
        }
        None => None,
    };

    tokio::pin!(shutdown);
    tokio::select! {
        _ = &mut shutdown => {
            let _ = stop_all.send(true);
            let _ = health.await;
            return Ok(());
        }
        acquired = leadership.acquired() => {
            if !acquired {
                let _ = stop_all.send(true);
                return Err(RuntimeError::LostLeadership);
            }
        }
    }
    tracing::info!("leading: starting every component");
    metrics.leader.set(1);

    // Backend state (executors, identities) is touched only by the leader: a standby
    // must not re-serve or re-adopt what the leader owns.
    // Identity: the controller's own CA (single host) or SPIRE's Workload API.
    let facade_spiffe_id = config
        .runner_facade_spiffe_id
        .clone()
        .ok_or_else(|| setup("runner_facade_spiffe_id is required"))?;
    let local_identity = if config.local_identity() {
        let ca = LocalCa::load_or_create(&config.state_dir.join("ca"), trust_domain.as_str())
            .map_err(setup)?;
        Some(Arc::new(LocalIdentity::new(ca, Duration::from_secs(3600))))
    } else {
        None
    };
    let facade_endpoint = match &local_identity {
        Some(local) => local
            .serve(
                config.state_dir.join("facade-workload.sock"),
                &facade_spiffe_id,
            )
            .await
            .map_err(setup)?,
        None => config
            .spiffe_endpoint_socket
            .clone()
            .ok_or_else(|| setup("spiffe_endpoint_socket is required"))?,
    };

    // Backends and their pools.
    let mut backends: Vec<(Arc<dyn ExecutorBackend>, usize)> = Vec::new();
    for (backend, component, capacity, kind) in [
        (
            Backend::Pod,
            Component::PodWorker,
            config.pod_capacity,
            config.pod_backend(),
        ),
        (
            Backend::Vm,
            Component::VmWorker,
            config.vm_capacity,
            config.vm_backend(),
        ),
    ] {
        if capacity == 0 || !config.components.contains(&component) {
            continue;
        }
        let adapter: Arc<dyn ExecutorBackend> = match kind {
            "process" => {
                let identity = local_identity
                    .clone()
                    .ok_or_else(|| setup("the process backend needs local_identity = true"))?;
                Arc::new(process_backend(&config, backend, &trust_domain, identity)?)
            }
            other => {
                return Err(setup(format!(
                    "{backend} backend {other:?} is not supported yet; set {backend}_backend = \"process\" for single-host mode"
                )));
            }
        };
        backends.push((adapter, capacity as usize));
    }
    let capacities: BTreeMap<Backend, usize> =
        backends.iter().map(|(b, c)| (b.backend(), *c)).collect();
    let dispatch = Arc::new(Dispatch::new(backends, capability_key));
    let _ = handles.dispatch.set(dispatch.clone());
    for backend in capacities.keys() {
        if let Some(adapter) = dispatch.backend(*backend) {
            let records = adapter.list().await.map_err(setup)?;
            let (admitted, claimed) = dispatch.restore(&records);
            tracing::info!(%backend, admitted, claimed, "restored executors from the backend");
        }
    }

    // Components, all stopped by `stop_work`.
    let (stop_work, work_rx) = watch::channel(false);
    let (sched_trigger, sched_shutdown) = shutdown_channel();
    let mut tasks = tokio::task::JoinSet::new();
    let stats = Arc::new(SchedulerStats::new());

    let facade = Arc::new(Facade::new(
        dispatch.clone(),
        gitea.clone(),
        None,
        config.vm_runner_label.clone(),
    ));
    if config.components.contains(&Component::Scheduler) {
        let labels = crate::register::default_labels(&config);
        let pollers = capacities.values().sum::<usize>().max(1);
        let mut settings = SchedulerSettings::new(
            labels,
            config.runner_capabilities.clone(),
            pollers,
            u64::from(config.effective_backlog_limit()),
        );
        settings.shutdown_publish_timeout = Duration::from_secs(30);
        let mut scheduler = Scheduler::new(
            gitea.clone(),
            js_producer.clone(),
            stream_settings.clone(),
            policy.clone(),
            settings,
        )
        .with_stats(stats.clone());
        if let Some(k) = &keyring {
            scheduler = scheduler.with_keyring(Arc::new(k.clone()));
        }
        let mut declared = scheduler.declared();
        let facade_for_caps = facade.clone();
        tokio::spawn(async move {
            if let Ok(d) = declared.wait_for(Option::is_some).await {
                facade_for_caps.set_server_capabilities(
                    d.as_ref().and_then(|d| d.server_capabilities.clone()),
                );
            }
        });
        let shutdown = sched_shutdown.clone();
        tasks.spawn(async move {
            (
                "scheduler",
                scheduler
                    .run(shutdown)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
            )
        });
        let heartbeater = Heartbeater::new(
            gitea.clone(),
            js_producer.clone(),
            stream_settings.clone(),
            config.heartbeat_interval,
        )
        .with_stats(stats.clone());
        let shutdown = sched_shutdown.clone();
        tasks.spawn(async move {
            heartbeater.run(shutdown).await;
            ("heartbeater", Ok(()))
        });

        // Facade.
        let source = gdr_identity::tls::x509_source(&facade_endpoint)
            .await
            .map_err(setup)?;
        let tls = Arc::new(
            gdr_identity::tls::facade_server_config(&source, trust_domain.as_str())
                .map_err(setup)?,
        );
        let proxy = ReverseProxy::new(&gitea_url, extra_ca.as_deref()).map_err(setup)?;
        let mut stop = work_rx.clone();
        let facade_listener = listeners.facade;
        let facade = facade.clone();
        tasks.spawn(async move {
            let _source = source;
            let result = facade
                .serve(facade_listener, tls, proxy, async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await;
            ("facade", result.map_err(|e| e.to_string()))
        });
    }

    let facade_url = config.runner_facade_url.clone().unwrap_or_default();
    let codec =
        gdr_core::metadata::MetadataCodec::new(config.metadata_prefix.clone()).map_err(setup)?;
    for (backend, capacity) in &capacities {
        let Some(adapter) = dispatch.backend(*backend) else {
            continue;
        };
        let stream_for_consumer = queue::open_stream(&js_worker, &stream_settings)
            .await
            .map_err(setup)?;
        let consumer = queue::ensure_consumer(
            &stream_for_consumer,
            &stream_settings,
            *backend,
            &ConsumerSettings {
                max_ack_pending: i64::try_from(*capacity).unwrap_or(i64::MAX),
                ack_wait: config.nats_ack_wait,
                max_deliver: -1,
            },
        )
        .await
        .map_err(setup)?;
        let settings = WorkerSettings {
            backend: *backend,
            full_delay: Duration::from_secs(5),
            not_ready_delay: Duration::from_secs(2),
            error_delay: Duration::from_secs(15),
            progress_interval: config.nats_ack_wait / 3,
            start_deadline: config.executor_start_deadline,
            facade_url: facade_url.clone(),
            facade_spiffe_id: facade_spiffe_id.clone(),
            runner_label: match backend {
                Backend::Pod => "pod".to_string(),
                Backend::Vm => config.vm_runner_label.clone(),
            },
            codec: codec.clone(),
        };
        let (outcome_tx, mut outcome_rx) = tokio::sync::mpsc::unbounded_channel();
        let worker = Worker::new(
            dispatch.clone(),
            gitea.clone(),
            policy.clone(),
            keyring.clone(),
            settings,
        )
        .map_err(setup)?
        .with_outcomes(outcome_tx);
        let stop = work_rx.clone();
        tasks.spawn(async move {
            (
                "worker",
                worker.run(consumer, stop).await.map_err(|e| e.to_string()),
            )
        });
        let metrics_for_outcomes = metrics.clone();
        let label = backend.as_str().to_string();
        tokio::spawn(async move {
            while let Some((_, outcome)) = outcome_rx.recv().await {
                metrics_for_outcomes
                    .assignments
                    .get_or_create(&OutcomeLabels {
                        backend: label.clone(),
                        outcome: outcome.as_str().into(),
                    })
                    .inc();
            }
        });
        let lifecycle = Lifecycle::new(dispatch.clone(), adapter, gitea.clone());
        let stop = work_rx.clone();
        tasks.spawn(async move {
            lifecycle.run(Duration::from_secs(2), stop).await;
            ("lifecycle", Ok(()))
        });
    }
    tasks.spawn(export_metrics(
        metrics.clone(),
        stats.clone(),
        dispatch.clone(),
        capacities.clone(),
        work_rx.clone(),
    ));
    readiness.set(true);

    let outcome = tokio::select! {
        _ = &mut shutdown => Ok(()),
        _ = leadership.lost() => Err(RuntimeError::LostLeadership),
        Some(joined) = tasks.join_next() => match joined {
            Ok((component, Err(message))) => Err(RuntimeError::Component { component, message }),
            Ok((component, Ok(()))) => Err(RuntimeError::Component { component, message: "stopped unexpectedly".into() }),
            Err(e) => Err(RuntimeError::Component { component: "task", message: e.to_string() }),
        },
    };
    // Invariant 4: stop fetching first; an in-flight fetch still publishes (bounded by
    // the scheduler's shutdown publish timeout); then stop the rest.
    readiness.set(false);
    metrics.leader.set(0);
    sched_trigger.trigger();
    let _ = stop_work.send(true);
    let drain = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(45), drain)
        .await
        .is_err()
    {
        tracing::warn!("components did not stop within 45s");
    }
    let _ = stop_all.send(true);
    if let Some(e) = elector {
        let _ = tokio::time::timeout(Duration::from_secs(10), e).await;
    }
    let _ = health.await;
    drop(embedded);
    outcome
}

/// Copies the scheduler's counters and the pools into Prometheus every second.
async fn export_metrics(
    metrics: Arc<Metrics>,
    stats: Arc<SchedulerStats>,
    dispatch: Arc<Dispatch>,
    capacities: BTreeMap<Backend, usize>,
    mut stop: watch::Receiver<bool>,
) -> (&'static str, Result<(), String>) {
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
        for kind in [
            crate::gitea::ErrorKind::Unauthenticated,
            crate::gitea::ErrorKind::NotFound,
            crate::gitea::ErrorKind::Invalid,
            crate::gitea::ErrorKind::Unavailable,
            crate::gitea::ErrorKind::Other,
        ] {
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
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.wait_for(|s| *s) => return ("metrics", Ok(())),
        }
    }
}

fn load_keyring(config: &Config) -> Result<Option<TaskKeyring>, RuntimeError> {
    let Some(current) = &config.task_encryption_key_file else {
        if !config.task_encryption_previous_key_files.is_empty() {
            return Err(setup(
                "task_encryption_previous_key_files needs task_encryption_key_file",
            ));
        }
        return Ok(None);
    };
    let load = |path: &PathBuf| -> Result<TaskKey, RuntimeError> {
        let bytes = std::fs::read(path).map_err(|e| {
            setup(format!(
                "task_encryption_key_file ({}): {e}",
                path.display()
            ))
        })?;
        TaskKey::from_file_contents(&bytes).map_err(|e| {
            setup(format!(
                "task_encryption_key_file ({}): {e}",
                path.display()
            ))
        })
    };
    let previous = config
        .task_encryption_previous_key_files
        .iter()
        .map(load)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(TaskKeyring::new(load(current)?, previous)))
}

fn process_backend(
    config: &Config,
    backend: Backend,
    trust_domain: &TrustDomain,
    identity: Arc<LocalIdentity>,
) -> Result<ProcessBackend, RuntimeError> {
    let program = match &config.executor_program {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .map_err(|e| setup(format!("locating this binary for executors: {e}")))?,
    };
    let label = match backend {
        Backend::Pod => "pod".to_string(),
        Backend::Vm => config.vm_runner_label.clone(),
    };
    let settings = ProcessBackendSettings {
        backend,
        state_root: config.state_dir.join(backend.as_str()),
        program,
        args: vec!["executor".into()],
        extra_env: BTreeMap::from([
            (
                "GITEA_RUNNER_BINARY".to_string(),
                config.runner_binary.display().to_string(),
            ),
            ("CI_RUNNER_LABEL".to_string(), label),
        ]),
        codec: gdr_core::metadata::MetadataCodec::new(config.metadata_prefix.clone())
            .map_err(setup)?,
        trust_domain: trust_domain.clone(),
        stop_grace: Duration::from_secs(10),
    };
    ProcessBackend::new(settings, identity).map_err(setup)
}

#[derive(Clone, Copy)]
enum Role {
    Producer,
    Worker,
}

/// Separate connections and credentials for the producer and the workers, as in the
/// Go version, so each can be granted only what it needs.
async fn connect_nats(
    config: &Config,
    url: &str,
    role: Role,
) -> Result<async_nats::Client, RuntimeError> {
    let (name, user, password_file, creds_file) = match role {
        Role::Producer => (
            "gitea-dynamic-runner-scheduler",
            &config.nats_producer_user,
            &config.nats_producer_password_file,
            &config.nats_producer_creds_file,
        ),
        Role::Worker => (
            "gitea-dynamic-runner-worker",
            &config.nats_worker_user,
            &config.nats_worker_password_file,
            &config.nats_worker_creds_file,
        ),
    };
    let mut options = async_nats::ConnectOptions::new()
        .name(name)
        .retry_on_initial_connect();
    if let Some(creds) = creds_file {
        options = async_nats::ConnectOptions::with_credentials_file(creds.clone())
            .await
            .map_err(|e| setup(format!("NATS credentials file {}: {e}", creds.display())))?
            .name(name)
            .retry_on_initial_connect();
    } else if let Some(path) = password_file {
        let key = match role {
            Role::Producer => "nats_producer_password_file",
            Role::Worker => "nats_worker_password_file",
        };
        let password = read_secret_file(key, path).map_err(setup)?;
        options = options.user_and_password(user.clone(), password);
    }
    if let Some(ca) = &config.nats_ca_file {
        options = options.add_root_certificates(ca.clone()).require_tls(true);
    }
    options.connect(url).await.map_err(|e| {
        setup(format!(
            "connecting to NATS at {}: {e}",
            crate::config::redact_url_userinfo(url)
        ))
    })
}
