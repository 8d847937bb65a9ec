//! The controller: claims Gitea Actions jobs, queues them in JetStream and runs each one
//! through an executor backend, serving the RunnerService facade its runners talk to.
//!
//! - Adapters: [`queue`] (JetStream), [`lease`] (Kubernetes Lease leader election), `kube_client` (the Kubernetes API
//!   client of the Lease and the Pod backend); the Gitea client is the crate
//!   [`gdr_gitea`].
//! - Components: [`scheduler`] (FetchTask pollers, heartbeats), [`worker`] (one per
//!   backend), [`dispatch`] (admission and claims shared by workers and facade), [`facade`]
//!   (the controller's side of the facade's ports; the facade is the crate [`gdr_facade`]),
//!   [`lifecycle`] (clean-up and failure reports), `held` (assignments sealed with an
//!   unknown task key).
//! - Wiring: [`settings`], [`cli`], `register`, [`runtime`], [`logging`], [`limits`] (the
//!   process's open-file limit), [`shutdown`] (the one stop signal), [`wake`] (a backend's
//!   change signal).
//! - Operating it: `metrics`, `health` (the health listener), [`status`] (what the
//!   controller is doing, for `/status`, the status page and the `status` subcommand).

pub(crate) mod backoff;
pub mod channel;
pub mod cli;
pub mod dispatch;
pub mod facade;
pub(crate) mod failpoint;
pub(crate) mod health;
pub(crate) mod held;
pub mod job_metrics;
pub(crate) mod kube_client;
pub mod lease;
pub mod lifecycle;
pub mod limits;
pub mod logging;
pub(crate) mod metrics;
pub mod ports;
pub mod queue;
pub(crate) mod register;
pub mod runtime;
pub mod scheduler;
pub mod settings;
pub mod shutdown;
pub mod status;
pub(crate) mod vocabulary;
pub mod wake;
pub mod worker;

/// Version string reported to Gitea and by `version`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
