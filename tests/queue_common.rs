//! Fixtures of the tests that put assignments on a real JetStream stream (`handoff`,
//! `queue_trust`, `scheduler`, `worker`).

use std::time::Duration;

use gdr_controller::queue::StreamSettings;
use gdr_core::assignment::DerivationPolicy;
use gdr_core::backend::BackendLabels;
use gdr_core::identity::{IdentityScheme, TrustDomain};

/// The stream name: the controller's default `nats_stream`, which the controllers that
/// `queue_trust` starts use too.
pub const STREAM: &str = "CI_RUNNER";

pub fn stream_settings() -> StreamSettings {
    StreamSettings {
        stream: STREAM.into(),
        subject_base: "ci.runner".into(),
        duplicate_window: Duration::from_secs(120),
    }
}

/// Assignments derived in trust domain `example.org` with the default backend labels.
pub fn policy() -> DerivationPolicy {
    DerivationPolicy {
        trust_domain: TrustDomain::new("example.org").expect("trust domain"),
        scheme: IdentityScheme::Ref,
        labels: BackendLabels::default(),
    }
}
