//! The executor: what runs next to the unmodified official runner inside each disposable
//! environment (Pod, VM or local process directory). It holds no controller credential.
//!
//! - [`cli`]: the command line of `gitea-dynamic-executor`, the executor's own binary (it
//!   links no controller code), and of the controller binary's `executor` alias.
//! - [`oneshot`]: reads the `CI_*` environment, writes a one-shot `.runner`, waits for the
//!   facade and runs the runner once (`daemon --once`).
//! - [`jobenv`]: started as root in its Pod or VM, the executor prepares the job's
//!   Docker storage, cgroups and agent socket, starts dockerd and runs the rest of itself
//!   as the runner's user.
//! - [`proxy`]: the loopback HTTP proxy the runner's `.runner` `address` points at; it
//!   forwards everything to the facade over mTLS with the executor's SVID.
//! - [`relay`]: the runner's RunnerService calls on their way to the facade: sent again
//!   while the facade is unreachable, reports held and answered as Gitea would until the
//!   facade has them ([`outbox`]).
//! - [`standby`]: a warm Pod's executor waits, with no assignment, for the job that
//!   claims its Pod.
//! - [`vm_standby`]: a warm VM sandbox's executor waits for its SVID, which comes with
//!   the claim, then asks the facade for its assignment.

pub mod cli;
mod descendants;
pub mod docker;
mod forward;
pub mod jobenv;
pub mod oneshot;
pub mod outbox;
pub mod proxy;
pub mod relay;
pub mod standby;
mod upstream;
pub mod vm_standby;
