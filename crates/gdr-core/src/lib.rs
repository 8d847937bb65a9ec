//! The pure domain of gitea-dynamic-runner. Nothing here performs I/O or depends on an
//! async runtime, an RPC stack or a cluster client: every function is a function of its
//! inputs (the Gitea `Task` a poller fetched, the operator's policy, key material handed in
//! as bytes), so the rules below are tested without any peer.
//!
//! - [`workflow`]: reads the single-job workflow Gitea sends with a task.
//! - [`backend`]: picks Pod or VM from the job's `runs-on` labels.
//! - [`identity`]: derives the job's SPIFFE ID (DESIGN invariant 13).
//! - [`capability`]: the assignment-scoped runner credential (invariant 14).
//! - [`assignment`]: the durable handoff document and its versioned envelope (invariant 5).
//! - [`capacity`]: admission pools (invariants 6, 7).
//! - [`metadata`]: the one codec of executor metadata (labels, annotations, markers), shared
//!   by every backend and compatible with the Go version.
//! - [`executor`]: the executor-backend contract the Pod, VM and process backends implement.

#![deny(missing_docs)]

pub mod assignment;
pub mod assignment_id;
pub mod backend;
pub mod backoff;
pub mod capability;
pub mod capacity;
pub mod executor;
pub mod identity;
pub mod metadata;
pub mod workflow;
