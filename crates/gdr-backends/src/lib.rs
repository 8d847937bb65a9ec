//! Executor backends, each an implementation of [`gdr_core::executor::ExecutorBackend`].
//!
//! - [`process`]: local child processes in per-assignment state directories (single host,
//!   and the full-chain tests).
//! - [`spire`]: process executors' identities registered in an existing SPIRE server, each
//!   executor under a uid of its own.
//! - [`opensandbox`] (feature `opensandbox`): sandboxes from an OpenSandbox pool (Kata
//!   microVMs) through the Lifecycle API.
//! - [`kubernetes`] (feature `kubernetes`): one Kubernetes Pod per job, bound to its SPIFFE
//!   identity through a SPIRE ClusterStaticEntry.
//! - [`warm`]: the backend-neutral plan of a warm pool, shared by the Pod and VM backends.

pub mod defaults;
#[cfg(feature = "opensandbox")]
pub mod opensandbox;
pub mod process;
pub mod spire;
pub mod warm;

#[cfg(feature = "kubernetes")]
pub mod kubernetes;
