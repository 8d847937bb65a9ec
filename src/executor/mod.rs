//! Executor side: what runs next to the official runner inside a disposable environment.
//!
//! - [`proxy`]: the loopback HTTP proxy the runner's `.runner` `address` points at; it
//!   forwards everything to the facade over mTLS with the executor's SVID.

pub mod oneshot;
pub mod proxy;
