//! The assignment-scoped credential an executor's runner presents (DESIGN invariant 14).
//!
//! The scheduler's Gitea registration token never reaches an executor. Instead each
//! assignment gets `base64url-nopad(HMAC-SHA256(key, "gitea-runner-assignment\0" + id))`.
//! It is deterministic, so a restarted controller can verify capabilities it issued before
//! without a token store; the algorithm is shared with the Go seed deployment.
//!
//! The same key also yields [`EnvelopeIdKey`], which authenticates the plaintext routing
//! fields of a sealed envelope (DESIGN invariant 21). It is a separate key derived under its
//! own label, never a capability, so a MAC in the queue is no executor's credential.

use std::fmt;

use aws_lc_rs::{constant_time, hmac};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use super::assignment_id::AssignmentId;

/// Minimum key length: HMAC-SHA256 gains nothing from more, and less is guessable.
pub const MIN_KEY_BYTES: usize = 32;

/// Domain separation: a MAC for this purpose can never be confused with another use of the key.
const CONTEXT: &[u8] = b"gitea-runner-assignment\0";

/// Derivation label of [`EnvelopeIdKey`]. It differs from [`CONTEXT`] in its seventh byte,
/// so no capability input (`CONTEXT` + an assignment ID) ever equals it: the derived key is
/// never a capability, and a MAC under it never verifies as one.
const ENVELOPE_ID_KEY_LABEL: &[u8] = b"gitea-dynamic-runner envelope id key\0";

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

impl CapabilityKey {
    /// The key that authenticates the routing fields of the envelopes this controller seals
    /// (`HMAC-SHA256(key, "gitea-dynamic-runner envelope id key\0")`). Every replica holds the
    /// capability key (a failover must verify the capabilities of running executors), and it
    /// does not rotate with the task keys, so the envelope ID can be checked where the task
    /// key is missing.
    pub fn envelope_id_key(&self) -> EnvelopeIdKey {
        let key = hmac::Key::new(hmac::HMAC_SHA256, &self.key);
        let derived = hmac::sign(&key, ENVELOPE_ID_KEY_LABEL);
        EnvelopeIdKey {
            key: hmac::Key::new(hmac::HMAC_SHA256, derived.as_ref()),
        }
    }
}

/// Authenticates the assignment ID (and the other plaintext fields) of a sealed envelope
/// without the task key (see [`CapabilityKey::envelope_id_key`]).
#[derive(Clone)]
pub struct EnvelopeIdKey {
    key: hmac::Key,
}

impl EnvelopeIdKey {
    /// HMAC-SHA256 of `data`.
    pub(crate) fn mac(&self, data: &[u8]) -> Vec<u8> {
        hmac::sign(&self.key, data).as_ref().to_vec()
    }

    /// Whether `mac` is the MAC of `data`, compared in constant time.
    pub(crate) fn verify(&self, data: &[u8], mac: &[u8]) -> bool {
        hmac::verify(&self.key, data, mac).is_ok()
    }
}

impl fmt::Debug for EnvelopeIdKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("EnvelopeIdKey(<redacted>)")
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

    /// DESIGN invariant 14: the key that authenticates envelope IDs in the queue is derived
    /// under its own label: a MAC of an assignment ID under it is not that assignment's
    /// capability, and it depends on the capability key.
    #[test]
    fn the_envelope_id_key_is_no_capability_and_depends_on_the_capability_key() {
        let key = CapabilityKey::new(KEY).unwrap();
        let other = CapabilityKey::new(b"fedcba9876543210fedcba9876543210").unwrap();
        let id = id(42);
        let mac = key.envelope_id_key().mac(id.as_str().as_bytes());
        assert_ne!(URL_SAFE_NO_PAD.encode(&mac), key.issue(&id).expose());
        assert!(!key.verify(id.as_str(), &URL_SAFE_NO_PAD.encode(&mac)));
        assert!(key.envelope_id_key().verify(id.as_str().as_bytes(), &mac));
        assert!(!other.envelope_id_key().verify(id.as_str().as_bytes(), &mac));
        assert_eq!(
            format!("{:?}", key.envelope_id_key()),
            "EnvelopeIdKey(<redacted>)"
        );
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
