//! Executor backends, each an implementation of [`gdr_core::executor::ExecutorBackend`].
//!
//! - [`process`]: local child processes in per-assignment state directories (single host,
//!   and the full-chain tests).

pub mod process;
