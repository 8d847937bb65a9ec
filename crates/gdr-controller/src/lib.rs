//! The controller: claims Gitea Actions jobs, queues them in JetStream and runs each one
//! through an executor backend, serving the RunnerService facade its runners talk to.
//!
//! - Adapters: [`gitea`] (Connect client for Gitea's RunnerService), [`queue`] (JetStream),
//!   [`lease`] (Kubernetes Lease leader election).
//! - Components: [`scheduler`] (FetchTask pollers, heartbeats), [`worker`] (one per
//!   backend), [`dispatch`] (admission and claims shared by workers and facade), [`facade`],
//!   [`lifecycle`] (clean-up and failure reports).
//! - Wiring: [`settings`], [`cli`], [`register`], [`runtime`], [`metrics`], [`logging`].

pub mod backoff;
pub mod cli;
pub(crate) mod client_tls;
pub mod dispatch;
pub mod facade;
pub mod failpoint;
pub mod gitea;
pub mod lease;
pub mod lifecycle;
pub mod logging;
pub mod metrics;
pub mod queue;
pub mod register;
pub mod runtime;
pub mod scheduler;
pub mod settings;
pub mod shutdown;
pub mod worker;

/// Version string reported to Gitea and by `version`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
