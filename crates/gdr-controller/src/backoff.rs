//! Capped exponential backoff with jitter (it lives in the domain crate, which the
//! executor shares).

pub use gdr_core::backoff::Backoff;
