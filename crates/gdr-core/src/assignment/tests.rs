use std::collections::BTreeMap;

use buffa_types::google::protobuf::{Struct, Value};
use proptest::prelude::*;

use super::*;
use crate::metadata::{DEFAULT_PREFIX, ExecutorMetadata, MetadataCodec, MetadataError};

/// The Go seed's test task: ID 42, repository `owner/repo`, one job `publish`.
fn seed_task(runs_on: &str) -> Task {
    task(42, "owner/repo", "publish", runs_on)
}

/// A task whose context has only `repository`, as the Go seed's tests built them.
fn task(id: i64, repository: &str, job_key: &str, runs_on: &str) -> Task {
    Task {
        id,
        context: Struct::from_fields([("repository", Value::from(repository))]).into(),
        workflow_payload: Some(
            format!("jobs:\n  {job_key}:\n    runs-on: {runs_on}\n    steps: []\n").into_bytes(),
        ),
        secrets: [("TOKEN".to_owned(), "s3cr3t-value".to_owned())]
            .into_iter()
            .collect(),
        ..Default::default()
    }
}

/// A task of a push to `git_ref`, as Gitea hands it out.
fn task_on(id: i64, repository: &str, job_key: &str, runs_on: &str, git_ref: &str) -> Task {
    let mut task = task(id, repository, job_key, runs_on);
    let context = task.context.as_option_mut().unwrap();
    context.insert("ref", Value::from(git_ref));
    context.insert("event_name", Value::from("push"));
    task
}

/// The Go seed's policy: its vectors (and the envelope mechanics tested with them) carry
/// IDs of the job scheme.
fn policy() -> DerivationPolicy {
    DerivationPolicy {
        trust_domain: TrustDomain::new("ddupan.top").unwrap(),
        scheme: IdentityScheme::Job,
        labels: BackendLabels::new("vm-dev").unwrap(),
    }
}

/// The default policy: SPIFFE IDs of the ref scheme.
fn ref_policy() -> DerivationPolicy {
    DerivationPolicy {
        scheme: IdentityScheme::Ref,
        ..policy()
    }
}

fn key(byte: u8) -> TaskKey {
    TaskKey::from_bytes([byte; 32])
}

fn keyring() -> TaskKeyring {
    TaskKeyring::new(key(1), vec![])
}

fn pod_assignment() -> Assignment {
    Assignment::from_task(seed_task("[self-hosted, pod]"), &policy()).unwrap()
}

/// A change to an envelope's JSON.
type Edit = fn(&mut serde_json::Value);

/// Edits one JSON field of an envelope.
fn edit(envelope: &[u8], change: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
    let mut value: serde_json::Value = serde_json::from_slice(envelope).unwrap();
    change(&mut value);
    serde_json::to_vec(&value).unwrap()
}

// === derivation ===

#[test]
fn the_backend_comes_from_runs_on_including_the_vm_alias() {
    for (runs_on, backend) in [
        ("[self-hosted, pod]", Backend::Pod),
        ("[self-hosted, vm]", Backend::Vm),
        ("[self-hosted, vm-dev]", Backend::Vm),
        ("{group: g, labels: [self-hosted, pod]}", Backend::Pod),
    ] {
        let assignment = Assignment::from_task(seed_task(runs_on), &policy()).unwrap();
        assert_eq!(assignment.backend(), backend, "{runs_on}");
        assert_eq!(assignment.id().as_str(), "gitea-task-42");
        assert_eq!(
            assignment.identity().spiffe_id(),
            "spiffe://ddupan.top/ci/owner/repo/publish"
        );
    }
}

#[test]
fn ambiguous_or_missing_backend_labels_make_no_assignment() {
    for runs_on in [
        "[self-hosted]",
        "[self-hosted, pod, vm]",
        "[pod]",
        "self-hosted",
    ] {
        assert!(
            matches!(
                Assignment::from_task(seed_task(runs_on), &policy()),
                Err(AssignmentError::Backend(_))
            ),
            "{runs_on}"
        );
    }
}

#[test]
fn a_task_without_a_positive_id_makes_no_assignment() {
    let mut task = seed_task("[self-hosted, pod]");
    task.id = 0;
    assert!(matches!(
        Assignment::from_task(task, &policy()),
        Err(AssignmentError::TaskId(_))
    ));
}

#[test]
fn assignment_ids_have_exactly_one_spelling_per_task() {
    let id = AssignmentId::parse("gitea-task-42").unwrap();
    assert_eq!(
        (id.task_id(), id.to_string()),
        (42, "gitea-task-42".to_owned())
    );
    assert_eq!(AssignmentId::from_task_id(42).unwrap(), id);
    for bad in [
        "gitea-task-0",
        "gitea-task--1",
        "gitea-task-+1",
        "gitea-task-042",
        "gitea-task-",
        "task-42",
        "gitea-task-42 ",
    ] {
        assert!(AssignmentId::parse(bad).is_err(), "{bad}");
    }
    assert_eq!(
        AssignmentId::from_task_id(-3),
        Err(AssignmentIdError::NotPositive(-3))
    );
}

#[test]
fn debug_output_of_an_assignment_shows_no_secret_or_payload() {
    let shown = format!("{:?}", pod_assignment());
    assert!(
        shown.contains("gitea-task-42") && shown.contains("Pod") && shown.contains("spiffe://"),
        "{shown}"
    );
    assert!(
        !shown.contains("s3cr3t") && !shown.contains("runs-on"),
        "{shown}"
    );
}

// === envelope v1 ===

/// Written by hand in the exact shape of the Go seed's `json.Marshal(envelope{...})`.
const SEED_V1: &str = concat!(
    r#"{"version":1,"id":"gitea-task-42","backend":"pod","#,
    r#""task":"CCoSP2pvYnM6CiAgcHVibGlzaDoKICAgIHJ1bnMtb246IFtzZWxmLWhvc3RlZCwgcG9kXQogICAgc3RlcHM6IFtdChocChoKCnJlcG9zaXRvcnkSDBoKb3duZXIvcmVwbw==","#,
    r#""identity":{"Repository":"owner/repo","Task":"publish","SPIFFEID":"spiffe://ddupan.top/ci/owner/repo/publish"}}"#
);

#[test]
fn a_v1_envelope_in_the_go_seed_shape_decodes() {
    let assignment = decode(SEED_V1.as_bytes(), &policy(), None).unwrap();
    assert_eq!(assignment.id().as_str(), "gitea-task-42");
    assert_eq!(assignment.backend(), Backend::Pod);
    assert_eq!(assignment.identity().repository(), "owner/repo");
    assert_eq!(assignment.identity().job_key(), "publish");
    assert_eq!(assignment.task().id, 42);
}

#[test]
fn encode_v1_is_byte_identical_to_the_go_seed() {
    let mut task = seed_task("[self-hosted, pod]");
    task.secrets.clear();
    let assignment = Assignment::from_task(task, &policy()).unwrap();
    assert_eq!(
        String::from_utf8(encode_v1(&assignment).unwrap()).unwrap(),
        SEED_V1
    );
}

#[test]
fn a_v1_envelope_round_trips_with_the_complete_task() {
    let assignment = pod_assignment();
    let decoded = decode(
        &encode_v1(&assignment).unwrap(),
        &policy(),
        Some(&keyring()),
    )
    .unwrap();
    assert_eq!(decoded, assignment);
    assert_eq!(
        decoded.task().secrets.get("TOKEN").map(String::as_str),
        Some("s3cr3t-value")
    );
}

#[test]
fn a_tampered_redundant_field_of_a_v1_envelope_is_rejected() {
    let envelope = encode_v1(&pod_assignment()).unwrap();
    let cases: [(&str, Edit); 5] = [
        ("id", |v| v["id"] = "gitea-task-43".into()),
        ("backend", |v| v["backend"] = "vm".into()),
        ("identity.Repository", |v| {
            v["identity"]["Repository"] = "owner/other".into()
        }),
        ("identity.Task", |v| v["identity"]["Task"] = "deploy".into()),
        ("identity.SPIFFEID", |v| {
            v["identity"]["SPIFFEID"] = "spiffe://ddupan.top/ci/owner/repo/deploy".into()
        }),
    ];
    for (field, change) in cases {
        assert_eq!(
            decode(&edit(&envelope, change), &policy(), None),
            Err(EnvelopeError::Tampered { field }),
            "{field}"
        );
    }
}

/// DESIGN invariants 5, 13: the scheme is part of the derivation consumers repeat, so an
/// envelope whose identity was derived under the other SPIFFE ID scheme (a forged or
/// rewritten one, or one written before `spiffe_id_scheme` changed) is refused as tampered,
/// v1 and v2 alike, never run under an identity this controller would not give its task.
#[test]
fn an_envelope_whose_identity_was_derived_under_the_other_scheme_is_refused_as_tampered() {
    let task = task_on(
        42,
        "owner/repo",
        "deploy",
        "[self-hosted, pod]",
        "refs/pull/7/head",
    );
    let by_ref = Assignment::from_task(task.clone(), &ref_policy()).unwrap();
    let by_job = Assignment::from_task(task, &policy()).unwrap();
    assert_eq!(
        by_ref.identity().spiffe_id(),
        "spiffe://ddupan.top/ci/owner/repo/pull/7/deploy"
    );
    assert_eq!(
        by_job.identity().spiffe_id(),
        "spiffe://ddupan.top/ci/owner/repo/deploy"
    );
    let tampered = Err(EnvelopeError::Tampered {
        field: "identity.SPIFFEID",
    });
    for (assignment, other) in [(&by_ref, policy()), (&by_job, ref_policy())] {
        let v1 = encode_v1(assignment).unwrap();
        assert_eq!(decode(&v1, &other, None), tampered, "v1 {assignment:?}");
        let v2 = encode_v2(assignment, &keyring()).unwrap();
        assert_eq!(
            decode(&v2, &other, Some(&keyring())),
            tampered,
            "v2 {assignment:?}"
        );
    }
    assert_eq!(
        decode(&encode_v1(&by_ref).unwrap(), &ref_policy(), None).unwrap(),
        by_ref
    );
}

/// DESIGN invariant 13: under the ref scheme a task without a `ref` makes no assignment,
/// naming the field; the job scheme never needed one.
#[test]
fn a_task_without_a_ref_makes_no_assignment_under_the_ref_scheme() {
    let err = Assignment::from_task(seed_task("[self-hosted, pod]"), &ref_policy()).unwrap_err();
    assert_eq!(err, AssignmentError::Identity(IdentityError::MissingRef));
    assert!(err.to_string().contains("no ref"), "{err}");
    Assignment::from_task(seed_task("[self-hosted, pod]"), &policy()).unwrap();
}

#[test]
fn a_tampered_backend_field_is_rejected() {
    let tampered = SEED_V1.replace(r#""backend":"pod""#, r#""backend":"vm""#);
    assert_eq!(
        decode(tampered.as_bytes(), &policy(), None),
        Err(EnvelopeError::Tampered { field: "backend" })
    );
}

#[test]
fn an_envelope_whose_task_is_invalid_is_rejected_as_invalid() {
    let mut task = seed_task("[self-hosted]");
    task.secrets.clear();
    let envelope = edit(SEED_V1.as_bytes(), |v| {
        v["task"] = STANDARD.encode(task.encode_to_vec()).into()
    });
    assert!(matches!(
        decode(&envelope, &policy(), None),
        Err(EnvelopeError::Invalid(AssignmentError::Backend(_)))
    ));
}

#[test]
fn malformed_envelopes_and_unknown_versions_are_told_apart() {
    let malformed = |bytes: &[u8]| {
        matches!(
            decode(bytes, &policy(), None),
            Err(EnvelopeError::Malformed(_))
        )
    };
    assert!(malformed(b"not json"));
    assert!(malformed(b"{}"));
    assert!(malformed(br#"{"version":"1"}"#));
    assert!(malformed(
        &edit(SEED_V1.as_bytes(), |v| v["task"] = "%%%".into())
    ));
    assert!(malformed(&edit(SEED_V1.as_bytes(), |v| v["task"] =
        STANDARD.encode([0xff, 0xff]).into())));
    assert!(malformed(
        &edit(SEED_V1.as_bytes(), |v| v["extra"] = 1.into())
    ));
    assert_eq!(
        decode(br#"{"version":3,"id":"x"}"#, &policy(), None),
        Err(EnvelopeError::UnsupportedVersion(3))
    );
    assert!(EnvelopeError::UnsupportedVersion(3).is_poison());
}

#[test]
fn envelope_errors_never_quote_the_payload() {
    // A JSON type error on the task field would make serde_json quote the value.
    let envelope = SEED_V1.replace("\"version\":1", "\"version\":1,\"version\":1");
    for bytes in [
        envelope.into_bytes(),
        edit(SEED_V1.as_bytes(), |v| v["task"] = "s3cr3t-value%".into()),
        edit(SEED_V1.as_bytes(), |v| {
            v["id"] = serde_json::json!(["s3cr3t-value"])
        }),
        b"{\"version\":1,\"task\":\"s3cr3t-value".to_vec(),
    ] {
        let err = decode(&bytes, &policy(), None).unwrap_err();
        assert!(!err.to_string().contains("s3cr3t"), "{err}");
    }
}

// === envelope v2 ===

#[test]
fn a_v2_envelope_round_trips_and_hides_the_task() {
    let assignment = pod_assignment();
    let envelope = encode_v2(&assignment, &keyring()).unwrap();
    let text = String::from_utf8(envelope.clone()).unwrap();
    assert!(
        text.starts_with(r#"{"version":2,"id":"gitea-task-42","backend":"pod","key_id":""#),
        "{text}"
    );
    let json: serde_json::Value = serde_json::from_slice(&envelope).unwrap();
    let sealed = STANDARD.decode(json["task"].as_str().unwrap()).unwrap();
    assert!(
        !sealed.windows(6).any(|w| w == b"s3cr3t"),
        "the task must not be readable"
    );
    assert_eq!(
        decode(&envelope, &policy(), Some(&keyring())).unwrap(),
        assignment
    );
}

#[test]
fn two_v2_envelopes_of_one_assignment_use_different_nonces() {
    let assignment = pod_assignment();
    let a = encode_v2(&assignment, &keyring()).unwrap();
    let b = encode_v2(&assignment, &keyring()).unwrap();
    assert_ne!(a, b);
}

#[test]
fn after_rotation_the_previous_key_still_decrypts() {
    let old = TaskKeyring::new(key(1), vec![]);
    let rotated = TaskKeyring::new(key(2), vec![key(1)]);
    let envelope = encode_v2(&pod_assignment(), &old).unwrap();
    assert_eq!(
        decode(&envelope, &policy(), Some(&rotated)).unwrap(),
        pod_assignment()
    );
    let fresh = encode_v2(&pod_assignment(), &rotated).unwrap();
    let json: serde_json::Value = serde_json::from_slice(&fresh).unwrap();
    assert_eq!(json["key_id"], key(2).key_id());
}

#[test]
fn an_envelope_sealed_with_an_unknown_key_is_rejected_by_key_id() {
    let envelope = encode_v2(&pod_assignment(), &TaskKeyring::new(key(9), vec![])).unwrap();
    assert_eq!(
        decode(&envelope, &policy(), Some(&keyring())),
        Err(EnvelopeError::UnknownKey(key(9).key_id().to_owned()))
    );
    assert_eq!(
        decode(&envelope, &policy(), None),
        Err(EnvelopeError::NoKeyring)
    );
}

#[test]
fn a_tampered_redundant_field_of_a_v2_envelope_is_rejected() {
    let envelope = encode_v2(&pod_assignment(), &keyring()).unwrap();
    let rotated = TaskKeyring::new(key(1), vec![key(2)]);
    let cases: [(&str, Edit); 7] = [
        ("id", |v| v["id"] = "gitea-task-43".into()),
        ("backend", |v| v["backend"] = "vm".into()),
        ("repository", |v| {
            v["identity"]["Repository"] = "owner/other".into()
        }),
        ("job key", |v| v["identity"]["Task"] = "deploy".into()),
        ("spiffe id", |v| {
            v["identity"]["SPIFFEID"] = "spiffe://ddupan.top/ci/x/y/z".into()
        }),
        // Naming another key the consumer holds must not open the envelope either.
        ("key_id", |v| {
            v["key_id"] = TaskKey::from_bytes([2; 32]).key_id().into()
        }),
        ("nonce", |v| v["nonce"] = STANDARD.encode([0u8; 12]).into()),
    ];
    for (field, change) in cases {
        let err = decode(&edit(&envelope, change), &policy(), Some(&rotated)).unwrap_err();
        assert!(
            matches!(err, EnvelopeError::Decrypt | EnvelopeError::Tampered { .. }),
            "{field}: {err}"
        );
    }
}

#[test]
fn ciphertext_moved_between_envelopes_does_not_decrypt() {
    let first = encode_v2(&pod_assignment(), &keyring()).unwrap();
    let other = Assignment::from_task(
        task(43, "owner/repo", "publish", "[self-hosted, pod]"),
        &policy(),
    )
    .unwrap();
    let second = encode_v2(&other, &keyring()).unwrap();
    let second: serde_json::Value = serde_json::from_slice(&second).unwrap();
    let swapped = edit(&first, |v| {
        v["task"] = second["task"].clone();
        v["nonce"] = second["nonce"].clone();
    });
    assert_eq!(
        decode(&swapped, &policy(), Some(&keyring())),
        Err(EnvelopeError::Decrypt)
    );
    // Moving the ciphertext together with the fields it is bound to yields that other,
    // consistent envelope, never a mix of the two.
    let moved = edit(&first, |v| {
        for field in ["id", "task", "nonce"] {
            v[field] = second[field].clone();
        }
    });
    assert_eq!(decode(&moved, &policy(), Some(&keyring())).unwrap(), other);
}

#[test]
fn a_malformed_key_id_or_nonce_is_malformed() {
    let envelope = encode_v2(&pod_assignment(), &keyring()).unwrap();
    for change in [
        (|v: &mut serde_json::Value| v["key_id"] = "XYZ".into()) as fn(&mut serde_json::Value),
        |v| v["nonce"] = STANDARD.encode([0u8; 11]).into(),
        |v| v["task"] = "***".into(),
    ] {
        let err = decode(&edit(&envelope, change), &policy(), Some(&keyring())).unwrap_err();
        assert!(matches!(err, EnvelopeError::Malformed(_)), "{err}");
    }
}

// === task keys ===

#[test]
fn task_key_files_accept_hex_and_every_base64_spelling_of_32_bytes() {
    let raw: Vec<u8> = (0u8..32).collect();
    let expected = TaskKey::from_bytes(raw.clone().try_into().unwrap());
    let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    for text in [
        hex.clone(),
        hex.to_uppercase(),
        format!("  {hex}\n"),
        STANDARD.encode(&raw) + "\n",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(&raw),
        base64::engine::general_purpose::URL_SAFE.encode(&raw),
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&raw),
    ] {
        let key = TaskKey::from_file_contents(text.as_bytes()).unwrap();
        assert_eq!(key.key_id(), expected.key_id(), "{text:?}");
    }
}

/// DESIGN invariant 5: a generated key file reads back as the same key, and two
/// generated keys differ.
#[test]
fn a_generated_task_key_reads_back_from_its_file_text() {
    let (key, text) = TaskKey::generate().unwrap();
    let read = TaskKey::from_file_contents(text.as_bytes()).unwrap();
    assert_eq!(read.key_id(), key.key_id());
    assert_ne!(TaskKey::generate().unwrap().0.key_id(), key.key_id());
}

#[test]
fn task_key_files_of_the_wrong_size_or_format_are_refused_with_a_hint() {
    let err = TaskKeyError::Length { len: 16 };
    assert_eq!(
        TaskKey::from_file_contents(STANDARD.encode([7u8; 16]).as_bytes()).unwrap_err(),
        err
    );
    assert_eq!(
        TaskKey::from_file_contents(b"not a key!").unwrap_err(),
        TaskKeyError::Format
    );
    assert_eq!(
        TaskKey::from_file_contents(b"").unwrap_err(),
        TaskKeyError::Length { len: 0 }
    );
    assert!(
        err.to_string().contains("head -c 32 /dev/urandom | base64"),
        "{err}"
    );
}

#[test]
fn the_task_key_id_is_derived_from_the_key_and_debug_hides_the_key() {
    let key = TaskKey::from_bytes([1; 32]);
    assert_eq!(key.key_id().len(), 16);
    assert!(is_key_id(key.key_id()));
    assert_ne!(key.key_id(), TaskKey::from_bytes([2; 32]).key_id());
    let shown = format!("{key:?}");
    assert!(
        shown.contains(key.key_id()) && !shown.contains("[1, 1"),
        "{shown}"
    );
}

// === backend metadata ===

fn seed_metadata() -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    use crate::metadata::DEFAULT_PREFIX as DEFAULT_METADATA_PREFIX;
    let map = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| (format!("{DEFAULT_METADATA_PREFIX}{k}"), (*v).to_owned()))
            .collect()
    };
    (
        map(&[
            ("assignment-id", "gitea-task-42"),
            ("task-id", "42"),
            ("backend", "vm"),
        ]),
        map(&[
            ("repository", "owner/repo"),
            ("job-key", "publish"),
            ("spiffe-id", "spiffe://ddupan.top/ci/owner/repo/publish"),
        ]),
    )
}

fn from_metadata(
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
    prefix: &str,
    td: &TrustDomain,
) -> Result<RecoveredAssignment, MetadataError> {
    MetadataCodec::new(prefix).unwrap().decode(
        &ExecutorMetadata {
            labels: labels.clone(),
            annotations: annotations.clone(),
        },
        td,
    )
}

#[test]
fn backend_metadata_written_by_the_go_version_recovers_the_minimal_assignment() {
    let (labels, annotations) = seed_metadata();
    let td = TrustDomain::new("ddupan.top").unwrap();
    let recovered = from_metadata(&labels, &annotations, DEFAULT_PREFIX, &td).unwrap();
    assert_eq!(recovered.task_id(), 42);
    assert_eq!(recovered.id().as_str(), "gitea-task-42");
    assert_eq!(recovered.backend(), Backend::Vm);
    assert_eq!(
        recovered.identity().spiffe_id(),
        "spiffe://ddupan.top/ci/owner/repo/publish"
    );
}

/// DESIGN invariants 7, 13: metadata records the identity under the scheme it was derived
/// by (the ref scheme's with a `ref` annotation) and reads back as exactly that identity.
#[test]
fn metadata_written_from_an_assignment_reads_back_as_the_same_assignment() {
    let under_ref = Assignment::from_task(
        task_on(
            42,
            "owner/repo",
            "publish",
            "[self-hosted, pod]",
            "refs/heads/feature/x",
        ),
        &ref_policy(),
    )
    .unwrap();
    for assignment in [pod_assignment(), under_ref] {
        let codec = MetadataCodec::new("x.example/").unwrap();
        let metadata = codec.encode(&RecoveredAssignment::from_assignment(&assignment));
        assert_eq!(
            metadata.annotations.get("x.example/ref").cloned(),
            assignment.identity().job_ref().map(ToString::to_string)
        );
        let recovered = codec.decode(&metadata, &policy().trust_domain).unwrap();
        assert_eq!(recovered.id(), assignment.id());
        assert_eq!(recovered.backend(), assignment.backend());
        assert_eq!(recovered.identity(), assignment.identity());
    }
}

#[test]
fn inconsistent_backend_metadata_is_rejected() {
    let td = TrustDomain::new("ddupan.top").unwrap();
    let p = DEFAULT_PREFIX;
    let cases: [(&str, &str, bool); 7] = [
        ("task-id", "0", true),
        ("task-id", "x", true),
        ("backend", "kata", true),
        ("assignment-id", "gitea-task-43", true),
        (
            "spiffe-id",
            "spiffe://ddupan.top/ci/owner/repo/other",
            false,
        ),
        ("job-key", "Publish images", false),
        ("repository", "owner", false),
    ];
    for (key, value, is_label) in cases {
        let (mut labels, mut annotations) = seed_metadata();
        let map = if is_label {
            &mut labels
        } else {
            &mut annotations
        };
        map.insert(format!("{p}{key}"), value.to_owned());
        assert!(
            from_metadata(&labels, &annotations, p, &td).is_err(),
            "{key}={value}"
        );
    }
    let (mut labels, annotations) = seed_metadata();
    labels.remove(&format!("{p}backend"));
    assert_eq!(
        from_metadata(&labels, &annotations, p, &td),
        Err(MetadataError::Missing(format!("{p}backend")))
    );
}

// === properties ===

/// Owner and repository names; `.` and `..` derive a dot segment and are refused (see
/// `names_that_derive_an_unusable_spiffe_id_make_no_identity`).
fn name() -> impl Strategy<Value = String> {
    "[A-Za-z0-9._@ü-]([A-Za-z0-9._ @ü-]{0,14}[A-Za-z0-9._@ü-])?"
        .prop_filter("a dot segment", |n| n != "." && n != "..")
}

proptest! {
    #[test]
    fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes, &policy(), Some(&keyring()));
    }

    #[test]
    fn decoding_json_like_text_never_panics(
        text in r#"\{("version"|"id"|"backend"|"task"|"key_id"|"nonce"|"identity"|"Repository"|"Task"|"SPIFFEID"|:|,|1|2|-1|1e99|"[A-Za-z0-9+/=]{0,8}"|null|\{|\}|\[|\]|true){0,40}\}?"#
    ) {
        let _ = decode(text.as_bytes(), &policy(), Some(&keyring()));
        let _ = decode(text.as_bytes(), &policy(), None);
    }

    #[test]
    fn mutated_envelopes_never_decode_to_another_assignment(
        v2 in any::<bool>(), index in any::<prop::sample::Index>(), byte in any::<u8>()
    ) {
        let assignment = pod_assignment();
        let mut envelope = if v2 { encode_v2(&assignment, &keyring()) } else { encode_v1(&assignment) }.unwrap();
        let at = index.index(envelope.len());
        envelope[at] = byte;
        if let Ok(decoded) = decode(&envelope, &policy(), Some(&keyring())) {
            prop_assert_eq!(decoded.id(), assignment.id());
            prop_assert_eq!(decoded.backend(), assignment.backend());
            prop_assert_eq!(decoded.identity(), assignment.identity());
        }
    }

    #[test]
    fn v1_and_v2_envelopes_round_trip(
        id in 1..i64::MAX,
        owner in name(),
        repo in name(),
        job_key in "[A-Za-z_][A-Za-z0-9_-]{0,20}",
        vm in any::<bool>(),
        by_ref in any::<bool>(),
        git_ref in "refs/(heads|tags|pull|for)/[A-Za-z0-9._/@ü-]{1,20}",
    ) {
        let runs_on = if vm { "[self-hosted, vm-dev]" } else { "[self-hosted, pod]" };
        let policy = if by_ref { ref_policy() } else { policy() };
        let task = task_on(id, &format!("{owner}/{repo}"), &job_key, runs_on, &git_ref);
        let assignment = match Assignment::from_task(task, &policy) {
            Ok(assignment) => assignment,
            // `refs/pull/` needs a number.
            Err(AssignmentError::Identity(IdentityError::InvalidRef(_))) => return Ok(()),
            Err(e) => return Err(TestCaseError::fail(e.to_string())),
        };
        prop_assert_eq!(assignment.id().task_id(), id);
        prop_assert_eq!(assignment.identity().job_key(), job_key.as_str());
        prop_assert_eq!(assignment.identity().scheme(), policy.scheme);
        let v1 = decode(&encode_v1(&assignment).unwrap(), &policy, None).unwrap();
        prop_assert_eq!(&v1, &assignment);
        let v2 = decode(&encode_v2(&assignment, &keyring()).unwrap(), &policy, Some(&keyring())).unwrap();
        prop_assert_eq!(&v2, &assignment);
        let codec = MetadataCodec::default();
        let metadata = codec.encode(&RecoveredAssignment::from_assignment(&assignment));
        let recovered = codec.decode(&metadata, &policy.trust_domain).unwrap();
        prop_assert_eq!(recovered.identity(), assignment.identity());
    }
}

#[test]
fn the_envelope_id_is_readable_without_the_key_in_both_versions() {
    let assignment = pod_assignment();
    let v2 = encode_v2(&assignment, &keyring()).unwrap();
    assert_eq!(envelope_id(&v2).as_ref(), Some(assignment.id()));
    let v1 = encode_v1(&assignment).unwrap();
    assert_eq!(envelope_id(&v1).as_ref(), Some(assignment.id()));
    assert_eq!(envelope_id(br#"{"id":"gitea-task-007"}"#), None);
    assert_eq!(envelope_id(b"not json"), None);
}

/// `Envelope` parses once what `envelope_id` and `decode_with` each read: the same ID, the
/// same assignment or refusal, for good, refused, malformed and foreign bytes alike.
#[test]
fn an_envelope_parsed_once_names_the_id_and_opens_as_the_bytes_decode() {
    let assignment = pod_assignment();
    let v2 = encode_v2(&assignment, &keyring()).unwrap();
    let v1 = encode_v1(&assignment).unwrap();
    let cases: Vec<Vec<u8>> = vec![
        v2.clone(),
        v1.clone(),
        // Readable ID, unknown field: malformed, yet named in the log.
        edit(&v2, |v| v["extra"] = 1.into()),
        edit(&v1, |v| v["task"] = "%%%".into()),
        edit(&v2, |v| v["version"] = 3.into()),
        br#"{"id":"gitea-task-007"}"#.to_vec(),
        b"not json".to_vec(),
    ];
    let stale = rules(SystemTime::now() + Duration::from_secs(24 * 3600));
    for bytes in &cases {
        let envelope = Envelope::parse(bytes);
        let text = String::from_utf8_lossy(bytes);
        assert_eq!(envelope.id(), envelope_id(bytes).as_ref(), "{text}");
        for (keys, rules) in [
            (Some(keyring()), EnvelopeRules::permissive()),
            (None, EnvelopeRules::permissive()),
            (Some(TaskKeyring::new(key(9), Vec::new())), stale),
            (Some(keyring()), stale),
        ] {
            assert_eq!(
                envelope.open(&policy(), keys.as_ref(), &rules),
                decode_with(bytes, &policy(), keys.as_ref(), &rules),
                "{text}"
            );
        }
    }
    let opened =
        Envelope::parse(&v2).open(&policy(), Some(&keyring()), &EnvelopeRules::permissive());
    assert_eq!(opened.unwrap().id(), assignment.id());
}

// === trust rules (invariants 20, 21) ===

fn rules(now: SystemTime) -> EnvelopeRules {
    EnvelopeRules {
        accept_plaintext: false,
        max_age: Duration::from_secs(3 * 3600),
        accept_undated: false,
        now,
    }
}

fn at(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(secs)
}

/// DESIGN invariant 21: where a task key is configured, a plaintext envelope proves nothing
/// about its writer (anyone who can publish can write one for any repository), so it is
/// refused unless the operator accepts plaintext for a migration; without a key it is the
/// only format and stays accepted.
#[test]
fn a_plaintext_envelope_is_refused_where_a_task_key_is_configured_unless_accepted() {
    let v1 = encode_v1(&pod_assignment()).unwrap();
    let now = SystemTime::now();
    assert_eq!(
        decode_with(&v1, &policy(), Some(&keyring()), &rules(now)),
        Err(EnvelopeError::Plaintext)
    );
    let accepting = EnvelopeRules {
        accept_plaintext: true,
        ..rules(now)
    };
    assert_eq!(
        decode_with(&v1, &policy(), Some(&keyring()), &accepting).unwrap(),
        pod_assignment()
    );
    assert_eq!(
        decode_with(&v1, &policy(), None, &rules(now)).unwrap(),
        pod_assignment()
    );
    assert!(EnvelopeError::Plaintext.is_poison());
}

/// DESIGN invariant 20: the fetch time travels authenticated in a v2 envelope; an envelope
/// older than the bound (Gitea has ended its task since) or from the future is refused,
/// and the time can be neither removed, added nor changed without breaking the tag.
#[test]
fn a_v2_envelope_carries_its_fetch_time_authenticated_and_old_ones_are_refused() {
    let fetched = at(1_800_000_000);
    let assignment = pod_assignment().with_fetch_time(fetched);
    let envelope = encode_v2(&assignment, &keyring()).unwrap();
    let opened = decode_with(
        &envelope,
        &policy(),
        Some(&keyring()),
        &rules(fetched + Duration::from_secs(3600)),
    )
    .unwrap();
    assert_eq!(opened.fetch_time(), Some(fetched));
    assert_eq!(opened, assignment);
    assert_eq!(
        decode_with(
            &envelope,
            &policy(),
            Some(&keyring()),
            &rules(fetched + Duration::from_secs(3 * 3600 + 1))
        ),
        Err(EnvelopeError::Expired {
            age: 3 * 3600 + 1,
            max_age: 3 * 3600
        })
    );
    assert_eq!(
        decode_with(
            &envelope,
            &policy(),
            Some(&keyring()),
            &rules(fetched - Duration::from_secs(3600))
        ),
        Err(EnvelopeError::FromTheFuture { ahead: 3600 })
    );
    let edits: [(&str, Edit); 3] = [
        ("removed", |v| {
            v.as_object_mut().unwrap().remove("fetched_at");
        }),
        ("younger", |v| {
            v["fetched_at"] = serde_json::json!(1_800_000_999u64)
        }),
        ("a string", |v| {
            v["fetched_at"] = serde_json::json!("1800000000")
        }),
    ];
    for (what, change) in edits {
        let edited = edit(&envelope, change);
        let result = decode_with(
            &edited,
            &policy(),
            Some(&keyring()),
            &rules(fetched + Duration::from_secs(60)),
        );
        assert!(
            matches!(
                result,
                Err(EnvelopeError::Decrypt | EnvelopeError::Malformed(_))
            ),
            "fetch time {what}: {result:?}"
        );
    }
}

/// DESIGN invariant 20: a v2 envelope written before the fetch time existed has no age
/// limit, so a copy could be replayed once its finished record expired: it is refused,
/// unless the operator admits undated envelopes while upgrading from such a release. v1
/// envelopes are governed by the plaintext rule alone.
#[test]
fn a_v2_envelope_without_a_fetch_time_is_refused_unless_undated_envelopes_are_admitted() {
    let envelope = encode_v2(&pod_assignment(), &keyring()).unwrap();
    let now = SystemTime::now();
    assert_eq!(
        decode_with(&envelope, &policy(), Some(&keyring()), &rules(now)),
        Err(EnvelopeError::Undated)
    );
    assert!(EnvelopeError::Undated.is_poison());
    let admitting = EnvelopeRules {
        accept_undated: true,
        ..rules(now)
    };
    assert_eq!(
        decode_with(&envelope, &policy(), Some(&keyring()), &admitting).unwrap(),
        pod_assignment()
    );
    let v1 = encode_v1(&pod_assignment()).unwrap();
    assert_eq!(
        decode_with(&v1, &policy(), None, &rules(now)).unwrap(),
        pod_assignment()
    );
}

/// A v2 envelope written before the fetch time existed still opens where undated envelopes
/// are admitted (its additional data is unchanged), and one without a fetch time cannot
/// gain one.
#[test]
fn a_v2_envelope_without_a_fetch_time_still_opens_and_cannot_gain_one() {
    let assignment = pod_assignment();
    let envelope = encode_v2(&assignment, &keyring()).unwrap();
    let json: serde_json::Value = serde_json::from_slice(&envelope).unwrap();
    assert!(json.get("fetched_at").is_none());
    let admitting = EnvelopeRules {
        accept_undated: true,
        ..rules(SystemTime::now())
    };
    let opened = decode_with(&envelope, &policy(), Some(&keyring()), &admitting).unwrap();
    assert_eq!(opened.fetch_time(), None);
    let gained = edit(&envelope, |v| {
        v["fetched_at"] = serde_json::json!(1_800_000_000u64);
    });
    assert_eq!(
        decode_with(&gained, &policy(), Some(&keyring()), &admitting),
        Err(EnvelopeError::Decrypt)
    );
}

fn id_key(byte: u8) -> crate::capability::EnvelopeIdKey {
    crate::capability::CapabilityKey::new(&[byte; 32])
        .unwrap()
        .envelope_id_key()
}

/// DESIGN invariant 21: a controller that lacks the task key an envelope was sealed with
/// can still tell whether its own scheduler wrote the assignment ID: `id_mac` verifies
/// under the key derived from the shared capability key, binds ID, backend, identity, key
/// ID and fetch time, and nothing else verifies: an envelope without it (older releases, v1),
/// one under another controller's key, or one with any bound field changed.
#[test]
fn the_id_mac_authenticates_the_assignment_id_without_the_task_key() {
    let fetched = at(1_800_000_000);
    let assignment = pod_assignment().with_fetch_time(fetched);
    let envelope = encode_v2_with_id_mac(&assignment, &keyring(), &id_key(7)).unwrap();
    let authenticated = authenticated_id(&envelope, &id_key(7)).expect("authenticated");
    assert_eq!(authenticated.id(), assignment.id());
    assert_eq!(authenticated.fetch_time(), Some(fetched));
    assert_eq!(
        authenticated.check_age(&rules(fetched + Duration::from_secs(3 * 3600 + 1))),
        Err(EnvelopeError::Expired {
            age: 3 * 3600 + 1,
            max_age: 3 * 3600
        })
    );
    assert_eq!(authenticated.check_age(&rules(fetched)), Ok(()));
    // The task key holder opens it as before; the MAC is no part of the sealed data.
    assert_eq!(
        decode_with(&envelope, &policy(), Some(&keyring()), &rules(fetched)).unwrap(),
        assignment
    );

    assert_eq!(authenticated_id(&envelope, &id_key(8)), None);
    let unmacced = encode_v2(&assignment, &keyring()).unwrap();
    assert_eq!(authenticated_id(&unmacced, &id_key(7)), None);
    assert_eq!(
        authenticated_id(&encode_v1(&assignment).unwrap(), &id_key(7)),
        None
    );
    let edits: [(&str, Edit); 8] = [
        ("id", |v| v["id"] = "gitea-task-43".into()),
        ("backend", |v| v["backend"] = "vm".into()),
        ("repository", |v| {
            v["identity"]["Repository"] = "owner/other".into()
        }),
        ("key_id", |v| v["key_id"] = key(9).key_id().into()),
        ("fetched_at", |v| {
            v["fetched_at"] = serde_json::json!(1_800_000_999u64)
        }),
        ("fetched_at removed", |v| {
            v.as_object_mut().unwrap().remove("fetched_at");
        }),
        ("id_mac removed", |v| {
            v.as_object_mut().unwrap().remove("id_mac");
        }),
        ("id_mac garbage", |v| v["id_mac"] = "***".into()),
    ];
    for (what, change) in edits {
        assert_eq!(
            authenticated_id(&edit(&envelope, change), &id_key(7)),
            None,
            "{what}"
        );
    }
}
