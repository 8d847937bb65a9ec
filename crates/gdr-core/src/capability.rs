//! The assignment-scoped credential an executor's runner presents (DESIGN invariant 14).
//!
//! The scheduler's Gitea registration token never reaches an executor. Instead each
//! assignment gets `base64url-nopad(HMAC-SHA256(key, "gitea-runner-assignment\0" + id))`.
//! It is deterministic, so a restarted controller can verify capabilities it issued before
//! without a token store; the algorithm is shared with the Go seed deployment.

use std::fmt;

use aws_lc_rs::{constant_time, hmac};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use super::assignment::AssignmentId;

/// Minimum key length: HMAC-SHA256 gains nothing from more, and less is guessable.
pub const MIN_KEY_BYTES: usize = 32;

/// Domain separation: a MAC for this purpose can never be confused with another use of the key.
const CONTEXT: &[u8] = b"gitea-runner-assignment\0";

/// The controller's capability key.
///
/// The seeds read it from a file and trim surrounding whitespace first (a trailing newline
/// is common); that trimming belongs to the caller reading the file, and must be kept for
/// keys shared with a Go deployment to produce the same capabilities.
#[derive(Clone)]
pub struct CapabilityKey {
    key: Vec<u8>,
}

/// A key shorter than [`MIN_KEY_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("runner capability key is {len} bytes; at least {MIN_KEY_BYTES} are required")]
pub struct CapabilityKeyTooShort {
    /// Length of the rejected key.
    pub len: usize,
}

impl CapabilityKey {
    /// Accepts a key of at least [`MIN_KEY_BYTES`] bytes, used as given.
    pub fn new(key: &[u8]) -> Result<Self, CapabilityKeyTooShort> {
        if key.len() < MIN_KEY_BYTES {
            return Err(CapabilityKeyTooShort { len: key.len() });
        }
        Ok(Self { key: key.to_vec() })
    }

    fn mac(&self, assignment_id: &str) -> String {
        let key = hmac::Key::new(hmac::HMAC_SHA256, &self.key);
        let mut context = hmac::Context::with_key(&key);
        context.update(CONTEXT);
        context.update(assignment_id.as_bytes());
        URL_SAFE_NO_PAD.encode(context.sign().as_ref())
    }

    /// The capability for `assignment_id`.
    pub fn issue(&self, assignment_id: &AssignmentId) -> Capability {
        Capability(self.mac(assignment_id.as_str()))
    }

    /// Whether `presented` is the capability for `assignment_id`, compared in constant time.
    /// An empty ID or capability never verifies.
    pub fn verify(&self, assignment_id: &str, presented: &str) -> bool {
        if assignment_id.is_empty() || presented.is_empty() {
            return false;
        }
        let expected = self.mac(assignment_id);
        constant_time::verify_slices_are_equal(expected.as_bytes(), presented.as_bytes()).is_ok()
    }
}

impl fmt::Debug for CapabilityKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CapabilityKey(<redacted>)")
    }
}

/// An issued capability. Its `Debug` never shows the value, so it can sit in structs that
/// get logged; [`Capability::expose`] is for the one place that hands it to an executor.
#[derive(Clone)]
pub struct Capability(String);

impl Capability {
    /// The capability text (`CI_RUNNER_CAPABILITY`, the `.runner` token).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Capability(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn id(task: i64) -> AssignmentId {
        AssignmentId::from_task_id(task).unwrap()
    }

    #[test]
    fn capability_matches_the_go_seed_vector() {
        let key = CapabilityKey::new(KEY).unwrap();
        let capability = key.issue(&id(42));
        assert_eq!(
            capability.expose(),
            "4k7dYwmRS3-V6PpvsKuQWOpMrWqi-hK3VZ1pjzHe1H4"
        );
        assert!(key.verify("gitea-task-42", capability.expose()));
    }

    #[test]
    fn a_capability_verifies_only_for_its_own_assignment_and_key() {
        let key = CapabilityKey::new(KEY).unwrap();
        let other = CapabilityKey::new(b"fedcba9876543210fedcba9876543210").unwrap();
        let capability = key.issue(&id(42));
        assert!(!key.verify("gitea-task-43", capability.expose()));
        assert!(!other.verify("gitea-task-42", capability.expose()));
        assert!(!key.verify("gitea-task-42", &capability.expose()[1..]));
        assert!(!key.verify("gitea-task-42", ""));
        assert!(!key.verify("", capability.expose()));
    }

    #[test]
    fn keys_shorter_than_32_bytes_are_refused() {
        assert_eq!(
            CapabilityKey::new(&KEY[..31]).unwrap_err(),
            CapabilityKeyTooShort { len: 31 }
        );
        assert!(CapabilityKey::new(&[0; 64]).is_ok());
    }

    #[test]
    fn debug_output_never_shows_the_key_or_the_capability() {
        let key = CapabilityKey::new(KEY).unwrap();
        let capability = key.issue(&id(42));
        assert_eq!(format!("{key:?}"), "CapabilityKey(<redacted>)");
        assert_eq!(format!("{capability:?}"), "Capability(<redacted>)");
    }

    proptest! {
        #[test]
        fn issued_capabilities_always_verify(task in 1..i64::MAX, key in proptest::collection::vec(any::<u8>(), 32..80)) {
            let key = CapabilityKey::new(&key).unwrap();
            let id = id(task);
            let capability = key.issue(&id);
            prop_assert!(key.verify(id.as_str(), capability.expose()));
        }
    }
}
