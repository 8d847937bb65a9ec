//! Test peers that speak the real protocols (compiled with the `testkit` feature).

pub mod fake_kube;
pub mod log_capture;
pub mod memory_backend;
pub mod mock_gitea;
pub mod nats_server;
pub mod spiffe;
pub mod standin_runner;
