//! Gitea's runner protocol (`runner.v1`, `ping.v1`, as in actions-proto-go v0.6.0), compiled
//! from `proto/` at build time with protox, so no `protoc` is needed.
//!
//! The messages (buffa) are always there; the Connect client and server stubs only with the
//! `connect` feature, so the domain crate can hold a `Task` without an RPC stack.

// Generated code: the lints are for the code we write.
#![allow(
    missing_docs,
    unused_qualifications,
    rust_2018_idioms,
    clippy::all,
    clippy::too_many_lines,
    refining_impl_trait
)]

include!(concat!(env!("OUT_DIR"), "/_connectrpc.rs"));
