//! gitea-dynamic-runner: claims Gitea Actions jobs through Gitea's runner protocol,
//! persists each one in NATS JetStream and runs it in a fresh, disposable environment.
//!
//! The module tree is the architecture:
//! - [`domain`]: pure logic (workflow parsing, backend selection, SPIFFE identity,
//!   capabilities, the assignment envelope). No I/O crate is imported there.
//! - adapters beside it: [`gitea`] (the Connect client for Gitea's RunnerService), ...
//! - wiring: [`config`], [`cli`], [`register`] and `main`.
//! - [`testkit`] (feature `testkit`): real-protocol test peers such as the mock Gitea.

pub mod cli;
pub mod config;
pub mod dispatch;
pub mod domain;
pub mod executor;
pub mod executors;
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
pub mod spiffe_tls;
#[cfg(feature = "testkit")]
pub mod testkit;
pub mod worker;
pub mod workload_api;

/// Generated protobuf messages (buffa) and Connect service stubs for `runner.v1` and `ping.v1`.
pub mod proto {
    #![allow(clippy::all, missing_docs, refining_impl_trait)]
    connectrpc::include_generated!();
}

/// Version string reported to Gitea and by `version`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
