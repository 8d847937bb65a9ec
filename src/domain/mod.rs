//! Pure domain logic; imports no I/O crate.
//!
//! Everything here is a function of its inputs: the Gitea `Task` a poller fetched, the
//! operator's policy (trust domain, backend labels) and key material handed in as bytes.
//! Adapters (Gitea client, JetStream, Kubernetes, OpenSandbox) sit outside and call in.
//!
//! - [`workflow`]: reads the single-job workflow Gitea sends with a task.
//! - [`backend`]: picks Pod or VM from the job's `runs-on` labels.
//! - [`identity`]: derives the job's SPIFFE ID (DESIGN invariant 13).
//! - [`capability`]: the assignment-scoped runner credential (invariant 14).
//! - [`assignment`]: the durable handoff document and its versioned envelope (invariant 5).

pub mod assignment;
pub mod backend;
pub mod capability;
pub mod capacity;
pub mod identity;
pub mod workflow;
