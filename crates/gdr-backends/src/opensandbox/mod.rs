//! OpenSandbox (Kata microVM pools) as the VM executor backend: a typed Lifecycle API
//! client ([`client`]) and the [`ExecutorBackend`](gdr_core::executor::ExecutorBackend)
//! on top of it ([`backend`]). Facts about the server: `shared/reference/opensandbox-1.1.1.md`.

pub mod backend;
pub mod client;
pub mod warm;

pub use backend::{InvalidSettings, OpenSandboxBackend, OpenSandboxError, OpenSandboxSettings};
pub use client::{ApiError, ApiKey, ClientError, ClientSettings, LifecycleClient};
