//! Assignment envelopes come off a shared stream; no byte sequence may crash a worker.
//! Run with `cargo fuzz run decode_envelope` from the repository root.
#![no_main]

use gdr_core::{
    assignment::{DerivationPolicy, TaskKey, TaskKeyring, decode, encode_v1},
    backend::BackendLabels,
    identity::{IdentityScheme, TrustDomain},
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (Ok(trust_domain), Ok(labels)) =
        (TrustDomain::new("ddupan.top"), BackendLabels::new("vm-dev"))
    else {
        return;
    };
    let policy = DerivationPolicy {
        trust_domain,
        labels,
        scheme: IdentityScheme::Ref,
    };
    let keyring = TaskKeyring::new(
        TaskKey::from_bytes([1; 32]),
        vec![TaskKey::from_bytes([2; 32])],
    );
    for keys in [None, Some(&keyring)] {
        if let Ok(assignment) = decode(data, &policy, keys) {
            // Whatever decodes must survive a re-encode unchanged: decode re-derives every
            // redundant field, so the envelope it would write is consistent by construction.
            let again = encode_v1(&assignment)
                .ok()
                .map(|bytes| decode(&bytes, &policy, None));
            assert!(matches!(again, Some(Ok(ref a)) if *a == assignment));
        }
    }
});
