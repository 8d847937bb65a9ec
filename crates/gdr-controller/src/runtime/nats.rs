//! The NATS side of the wiring: the producer's and the workers' connections (and the
//! embedded server of single-host mode), the stream, the consumers, the finished-assignments
//! bucket, and the watch that keeps `nats_connected` current.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use gdr_core::backend::Backend;

use super::embedded_nats::{EmbeddedNats, Launch};
use super::{METRICS_INTERVAL, RuntimeError, in_context, setup, step};
use crate::metrics::Metrics;
use crate::ports::QueueDepth;
use crate::queue::{self, ConsumerSettings, FinishedAssignments, StreamSettings};
use crate::settings::{
    self, NatsAuth, NatsServer, NatsSettings, SecretPermissions, check_secret_file_mode,
    read_secret_file_with,
};
use crate::shutdown::Shutdown;
use crate::worker::Worker;

/// JetStream drops a repeated message ID within this window (a retried publish). Two
/// minutes is JetStream's default and far longer than any publish retry loop.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// Finished assignments are remembered this much longer than a task may live, so clock
/// skew between replicas never opens a gap between the record expiring and the envelope
/// counting as too old.
const FINISHED_MARGIN: Duration = Duration::from_secs(3600);
/// The producer and worker connections, and the embedded server when there is one.
pub(super) struct Queue {
    pub(super) producer: jetstream::Context,
    pub(super) worker: jetstream::Context,
    pub(super) stream: StreamSettings,
    /// Stopped when the queue is dropped, after every component.
    _embedded: Option<EmbeddedNats>,
}

#[derive(Clone, Copy)]
enum Role {
    Producer,
    Worker,
}

impl Queue {
    pub(super) async fn connect(
        nats: &NatsSettings,
        state_dir: &Path,
        secrets: SecretPermissions,
    ) -> Result<Self, RuntimeError> {
        let stream = StreamSettings {
            stream: nats.stream.clone(),
            subject_base: nats.subject_base.clone(),
            duplicate_window: DUPLICATE_WINDOW,
        };
        let (url, producer_auth, worker_auth, embedded, ca) = match &nats.server {
            NatsServer::Embedded { binary, binder } => {
                let binder = match binder {
                    Some(b) => b.clone(),
                    None => std::env::current_exe()
                        .map_err(setup("locating this binary for the embedded nats-server"))?,
                };
                let launch = Launch {
                    binary: binary.clone(),
                    binder,
                };
                let server = EmbeddedNats::start(&launch, &state_dir.join("nats"))
                    .await
                    .map_err(setup("starting the embedded nats-server"))?;
                (
                    server.url(),
                    NatsAuth::clone(&server.producer_auth()),
                    server.worker_auth(),
                    Some(server),
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
                producer.clone(),
                worker.clone(),
                None,
                ca_file.clone(),
            ),
        };
        let producer =
            connect(&url, Role::Producer, &producer_auth, ca.as_deref(), secrets).await?;
        let worker = connect(&url, Role::Worker, &worker_auth, ca.as_deref(), secrets).await?;
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

    /// Lets `worker` offer the assignments of adopted, unclaimed executors now instead of
    /// after their redelivery (`nats_ack_wait` after the previous controller died).
    pub(super) async fn resume_adopted(&self, worker: &Worker, backend: Backend) {
        match queue::open_stream(&self.worker, &self.stream).await {
            Ok(stream) => {
                let resumed = worker
                    .resume_adopted(&stream, &self.stream.subject(backend))
                    .await;
                if resumed > 0 {
                    tracing::info!(%backend, resumed, "resumed adopted executors waiting for their task");
                }
            }
            Err(e) => {
                tracing::warn!(%backend, error = %e, "cannot read the stream to resume adopted executors")
            }
        }
    }

    /// The finished-assignments bucket (created with the stream, else provisioned).
    pub(super) async fn finished(
        &self,
        nats: &NatsSettings,
    ) -> Result<FinishedAssignments, RuntimeError> {
        FinishedAssignments::open(
            &self.worker,
            &nats.security.finished_bucket,
            nats.security.task_lifetime + FINISHED_MARGIN,
            nats.create_stream,
        )
        .await
        .map_err(setup("opening the finished-assignments bucket"))
    }

    pub(super) async fn consumer(
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
    secrets: SecretPermissions,
) -> Result<async_nats::Client, RuntimeError> {
    let name = match role {
        Role::Producer => "gitea-dynamic-runner-scheduler",
        Role::Worker => "gitea-dynamic-runner-worker",
    };
    let mut options = match auth {
        NatsAuth::Creds(path) => {
            let key = match role {
                Role::Producer => "nats_producer_creds_file",
                Role::Worker => "nats_worker_creds_file",
            };
            check_secret_file_mode(key, path, secrets)
                .map_err(setup("reading the NATS credentials file"))?;
            async_nats::ConnectOptions::with_credentials_file(path.clone())
                .await
                .map_err(|e| {
                    step("reading the NATS credentials file")(in_context(path.display(), e))
                })?
        }
        NatsAuth::Password { user, file, key } => {
            let password = read_secret_file_with(key, file, secrets)
                .map_err(setup("reading a NATS password"))?;
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
    options
        .connect(url)
        .await
        .map_err(|e| step("connecting to NATS")(in_context(settings::redact_url_userinfo(url), e)))
}

pub(super) async fn queue_depth(queue: &Queue) -> Option<Arc<dyn QueueDepth>> {
    match queue::ConsumerDepth::open(&queue.worker, &queue.stream).await {
        Ok(depth) => Some(Arc::new(depth)),
        Err(e) => {
            tracing::warn!(error = %e, "cannot open the stream to read queue depths; /status and queue_depth report them as unknown");
            None
        }
    }
}

/// Keeps `nats_connected` in step with each connection's state, for the whole process
/// (a standby's connections matter too).
pub(super) fn watch_nats(
    metrics: Arc<Metrics>,
    queue: &Queue,
    stop: Shutdown,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let connections = vec![
        ("producer", queue.producer.client()),
        ("worker", queue.worker.client()),
    ];
    watch_connections(metrics, connections, stop)
}

async fn watch_connections(
    metrics: Arc<Metrics>,
    connections: Vec<(&'static str, async_nats::Client)>,
    stop: Shutdown,
) {
    let mut was: Vec<Option<bool>> = vec![None; connections.len()];
    loop {
        for ((name, client), was) in connections.iter().zip(was.iter_mut()) {
            let up = client.connection_state() == async_nats::connection::State::Connected;
            metrics
                .nats_connected
                .get_or_create(&crate::metrics::ConnectionLabel {
                    connection: (*name).to_owned(),
                })
                .set(i64::from(up));
            if *was == Some(true) && !up {
                tracing::warn!(
                    connection = name,
                    "lost the NATS connection; reconnecting (fetching pauses, queued jobs stay stored)"
                );
            } else if *was == Some(false) && up {
                tracing::info!(connection = name, "NATS connection back");
            }
            *was = Some(up);
        }
        if !stop.sleep(METRICS_INTERVAL).await {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 41 item 3: a NATS error keeps its cause. A credentials file async-nats cannot
    /// parse fails the start with the file named and the library's own error reachable as
    /// a source, so a log line or `/status` can print the whole chain (it was flattened
    /// into a string, ending the chain at the step).
    #[tokio::test]
    async fn a_nats_start_up_error_keeps_the_librarys_cause_as_its_source() {
        let dir = tempfile::tempdir().unwrap();
        let creds = dir.path().join("worker.creds");
        std::fs::write(&creds, "not a credentials file\n").unwrap();
        let refused = connect(
            "nats://127.0.0.1:4222",
            Role::Worker,
            &NatsAuth::Creds(creds.clone()),
            None,
            SecretPermissions::Unchecked,
        )
        .await
        .unwrap_err();
        let mut causes = Vec::new();
        let mut cause = std::error::Error::source(&refused);
        while let Some(c) = cause {
            causes.push(c);
            cause = c.source();
        }
        assert!(
            causes[0]
                .to_string()
                .starts_with(&creds.display().to_string()),
            "the file is named: {refused}"
        );
        assert!(
            causes
                .iter()
                .any(|c| c.downcast_ref::<std::io::Error>().is_some()),
            "async-nats's error is a source of {refused:?}"
        );
    }
}
