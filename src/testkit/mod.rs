//! Test peers that speak the real protocols.

pub mod nats_server;
