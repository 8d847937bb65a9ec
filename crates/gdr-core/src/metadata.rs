//! The one codec of executor metadata (DESIGN invariants 8–11 and the compatibility
//! contract): what every backend writes on its executor object (Pod labels and
//! annotations, OpenSandbox metadata, the process backend's `metadata.json`) and reads back
//! after a restart.
//!
//! | key (after the prefix) | where | value |
//! |---|---|---|
//! | `runner` | label | `true`: selects runner executors (`sandbox-identity`, list filters) |
//! | `assignment-id` | label | `gitea-task-<task id>` |
//! | `task-id` | label | the Gitea task ID |
//! | `backend` | label | `pod` or `vm` |
//! | `claimed` | label marker | `true` once the runner claimed its task (invariant 9) |
//! | `terminal` | label marker | `true` once Gitea accepted a result (invariant 10) |
//! | `repository`, `job-key`, `spiffe-id` | annotations | the job's identity |
//!
//! Label values are limited to 63 characters of `[A-Za-z0-9._-]`, which the annotations
//! break (`owner/repo`, `spiffe://…`). Where a backend has labels only (OpenSandbox), the
//! annotations travel as deterministic chunks `<prefix>annotations-000`, `-001`, … of
//! base64url (no padding) of their JSON object, exactly as the Go version writes them, and
//! are decoded losslessly ([`MetadataCodec::flatten`], [`MetadataCodec::unflatten`]).
//!
//! Everything read back is re-validated ([`MetadataCodec::decode`]): the metadata lives on
//! an object others can write, so it is never trusted as it is.

use std::collections::BTreeMap;
use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use crate::assignment::{AssignmentId, RecoveredAssignment};
use crate::backend::Backend;
use crate::identity::{Identity, IdentityError, TrustDomain};

/// Default prefix of the metadata keys, shared with the Go version.
pub const DEFAULT_PREFIX: &str = "ci.ddupan.top/";

/// Key names after the prefix.
pub mod keys {
    /// Label selecting runner executors; its value is always `true`.
    pub const RUNNER: &str = "runner";
    /// Label holding the assignment ID.
    pub const ASSIGNMENT_ID: &str = "assignment-id";
    /// Label holding the Gitea task ID.
    pub const TASK_ID: &str = "task-id";
    /// Label holding the backend.
    pub const BACKEND: &str = "backend";
    /// Label marker: the runner claimed its task.
    pub const CLAIMED: &str = "claimed";
    /// Label marker: Gitea accepted a terminal result.
    pub const TERMINAL: &str = "terminal";
    /// Annotation holding `owner/repo`.
    pub const REPOSITORY: &str = "repository";
    /// Annotation holding the job key.
    pub const JOB_KEY: &str = "job-key";
    /// Annotation holding the SPIFFE ID.
    pub const SPIFFE_ID: &str = "spiffe-id";
    /// Annotation holding what the job runs for as `<kind>:<name>` (`branch:main`,
    /// `pull:7`): present exactly when the SPIFFE ID is of the ref scheme, so executors
    /// the Go version or the job scheme recorded decode as they were.
    pub const REF: &str = "ref";
    /// Prefix of the annotation chunks in label-only metadata (`annotations-000`, …).
    pub const ANNOTATION_CHUNK: &str = "annotations-";
}

/// The value of every marker and of the `runner` label.
pub const TRUE: &str = "true";

/// Longest label value Kubernetes and OpenSandbox accept.
pub const MAX_LABEL_VALUE: usize = 63;

/// Kubernetes' bound on the prefix of a label key (a DNS subdomain).
const MAX_PREFIX_BYTES: usize = 253;

/// A durable marker on an executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marker {
    /// The runner claimed its task through the facade.
    Claimed,
    /// Gitea accepted a terminal result, or the controller failed the task.
    Terminal,
}

impl Marker {
    fn key(self) -> &'static str {
        match self {
            Marker::Claimed => keys::CLAIMED,
            Marker::Terminal => keys::TERMINAL,
        }
    }
}

/// Labels and annotations of one executor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecutorMetadata {
    /// Short, selectable values.
    pub labels: BTreeMap<String, String>,
    /// Values that are too long or contain characters labels do not allow.
    pub annotations: BTreeMap<String, String>,
}

/// A metadata prefix that cannot prefix a Kubernetes label key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "metadata prefix {0:?} must be a DNS subdomain followed by '/' (e.g. \"ci.example.org/\"), at most 253 characters before the '/'"
)]
pub struct InvalidPrefix(pub String);

/// Why metadata read back from a backend does not describe a valid assignment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetadataError {
    /// A required label or annotation is absent.
    #[error("metadata lacks {0:?}")]
    Missing(String),
    /// The task ID is not a positive integer.
    #[error("metadata has invalid task ID {0:?}")]
    InvalidTaskId(String),
    /// The backend is neither `pod` nor `vm`.
    #[error("metadata has invalid backend {0:?}")]
    InvalidBackend(String),
    /// The assignment ID is not the one of the task ID.
    #[error("metadata assignment ID {found:?} does not match its task ID (expected {expected:?})")]
    AssignmentIdMismatch {
        /// The recorded assignment ID.
        found: String,
        /// The ID the task ID derives.
        expected: String,
    },
    /// The identity does not validate.
    #[error("metadata identity: {0}")]
    Identity(#[from] IdentityError),
    /// The annotation chunks are missing, out of sequence or do not decode.
    #[error("metadata annotation chunks: {0}")]
    Chunks(&'static str),
}

/// Encodes and decodes executor metadata under one prefix.
#[derive(Clone, PartialEq, Eq)]
pub struct MetadataCodec {
    prefix: String,
}

impl fmt::Debug for MetadataCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MetadataCodec({:?})", self.prefix)
    }
}

impl Default for MetadataCodec {
    fn default() -> Self {
        MetadataCodec {
            prefix: DEFAULT_PREFIX.to_owned(),
        }
    }
}

fn is_dns_subdomain(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= MAX_PREFIX_BYTES
        && text.split('.').all(|label| {
            let bytes = label.as_bytes();
            !bytes.is_empty()
                && bytes.len() <= 63
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
                && bytes.first() != Some(&b'-')
                && bytes.last() != Some(&b'-')
        })
}

/// Whether `value` is a valid label value (Kubernetes and OpenSandbox rules): at most 63
/// characters of `[A-Za-z0-9._-]`, starting and ending alphanumeric; empty is allowed.
pub fn is_label_value(value: &str) -> bool {
    let bytes = value.as_bytes();
    bytes.is_empty()
        || (bytes.len() <= MAX_LABEL_VALUE
            && bytes
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
            && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
            && bytes.last().is_some_and(u8::is_ascii_alphanumeric))
}

impl MetadataCodec {
    /// A codec for `prefix`, which must be a DNS subdomain followed by `/`.
    pub fn new(prefix: impl Into<String>) -> Result<Self, InvalidPrefix> {
        let prefix = prefix.into();
        match prefix.strip_suffix('/') {
            Some(domain) if is_dns_subdomain(domain) => Ok(MetadataCodec { prefix }),
            _ => Err(InvalidPrefix(prefix)),
        }
    }

    /// The prefix, ending in `/`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `<prefix><name>`.
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The metadata recording `assignment` on a new executor: the `runner` label, the
    /// routing labels and the identity annotations; no marker is set.
    pub fn encode(&self, assignment: &RecoveredAssignment) -> ExecutorMetadata {
        let identity = assignment.identity();
        ExecutorMetadata {
            labels: BTreeMap::from([
                (self.key(keys::RUNNER), TRUE.to_owned()),
                (
                    self.key(keys::ASSIGNMENT_ID),
                    assignment.id().as_str().to_owned(),
                ),
                (self.key(keys::TASK_ID), assignment.task_id().to_string()),
                (
                    self.key(keys::BACKEND),
                    assignment.backend().as_str().to_owned(),
                ),
            ]),
            annotations: BTreeMap::from_iter(
                [
                    (self.key(keys::REPOSITORY), identity.repository().to_owned()),
                    (self.key(keys::JOB_KEY), identity.job_key().to_owned()),
                    (self.key(keys::SPIFFE_ID), identity.spiffe_id().to_owned()),
                ]
                .into_iter()
                .chain(
                    identity
                        .job_ref()
                        .map(|job_ref| (self.key(keys::REF), job_ref.to_string())),
                ),
            ),
        }
    }

    /// Rebuilds the assignment an executor's metadata records, validating every field
    /// again: the assignment ID must be the one of the task ID and the SPIFFE ID the one
    /// repository, ref and job key derive, so a rewritten object cannot claim another
    /// identity. The scheme is the one the metadata records (a `ref` annotation or none),
    /// not the one configured now: an executor created before `spiffe_id_scheme` changed,
    /// or by the Go version, keeps the identity it was bound to.
    pub fn decode(
        &self,
        metadata: &ExecutorMetadata,
        trust_domain: &TrustDomain,
    ) -> Result<RecoveredAssignment, MetadataError> {
        let get = |map: &BTreeMap<String, String>, name: &str| {
            let key = self.key(name);
            map.get(&key).cloned().ok_or(MetadataError::Missing(key))
        };
        let task_id_text = get(&metadata.labels, keys::TASK_ID)?;
        let id = task_id_text
            .parse::<i64>()
            .ok()
            .and_then(|task_id| AssignmentId::from_task_id(task_id).ok())
            .ok_or(MetadataError::InvalidTaskId(task_id_text))?;
        let backend_text = get(&metadata.labels, keys::BACKEND)?;
        let backend: Backend = backend_text
            .parse()
            .map_err(|_| MetadataError::InvalidBackend(backend_text))?;
        let found = get(&metadata.labels, keys::ASSIGNMENT_ID)?;
        if found != id.as_str() {
            return Err(MetadataError::AssignmentIdMismatch {
                found,
                expected: id.as_str().to_owned(),
            });
        }
        let identity = Identity::from_metadata(
            &get(&metadata.annotations, keys::REPOSITORY)?,
            &get(&metadata.annotations, keys::JOB_KEY)?,
            metadata
                .annotations
                .get(&self.key(keys::REF))
                .map(String::as_str),
            &get(&metadata.annotations, keys::SPIFFE_ID)?,
            trust_domain,
        )?;
        Ok(RecoveredAssignment::new(id, backend, identity))
    }

    /// The label that sets `marker`.
    pub fn marker(&self, marker: Marker) -> (String, String) {
        (self.key(marker.key()), TRUE.to_owned())
    }

    /// Whether `labels` carry `marker`.
    pub fn has_marker(&self, labels: &BTreeMap<String, String>, marker: Marker) -> bool {
        labels.get(&self.key(marker.key())).map(String::as_str) == Some(TRUE)
    }

    /// `<prefix>runner=true`: the label selector of every runner executor.
    pub fn runner_selector(&self) -> String {
        format!("{}={TRUE}", self.key(keys::RUNNER))
    }

    /// `<prefix>assignment-id=<id>`: the label selector of one assignment's executor.
    pub fn assignment_selector(&self, id: &AssignmentId) -> String {
        format!("{}={id}", self.key(keys::ASSIGNMENT_ID))
    }

    /// Label-only form of `metadata`: its labels, plus its annotations as base64url chunks
    /// (`<prefix>annotations-000`, …) of their JSON object, as the Go version writes them.
    ///
    /// The Go version cut every 63 characters, which can make a chunk start or end with `-`
    /// or `_`, a value Kubernetes and OpenSandbox refuse. Here a chunk ends where both
    /// neighbouring characters are alphanumeric (at most 63 characters), so every chunk is a
    /// valid label value; the concatenation is the same, so each side reads the other's
    /// chunks. Deterministic: the same metadata always gives the same chunks.
    pub fn flatten(
        &self,
        metadata: &ExecutorMetadata,
    ) -> Result<BTreeMap<String, String>, MetadataError> {
        let mut flat = metadata.labels.clone();
        let json = serde_json::to_vec(&metadata.annotations)
            .map_err(|_| MetadataError::Chunks("annotations do not serialise"))?;
        // JSON objects start with `{` and end with `}`, whose base64 digits are alphanumeric
        // whatever the length, so only the cuts in between need care.
        let encoded = URL_SAFE_NO_PAD.encode(json);
        let bytes = encoded.as_bytes();
        let mut start = 0;
        let mut index = 0;
        while start < bytes.len() {
            let mut end = (start + MAX_LABEL_VALUE).min(bytes.len());
            while end < bytes.len()
                && !(bytes[end - 1].is_ascii_alphanumeric() && bytes[end].is_ascii_alphanumeric())
            {
                end -= 1;
                if end == start {
                    return Err(MetadataError::Chunks(
                        "annotations cannot be cut into valid label values",
                    ));
                }
            }
            flat.insert(self.chunk_key(index), encoded[start..end].to_owned());
            start = end;
            index += 1;
        }
        Ok(flat)
    }

    fn chunk_key(&self, index: usize) -> String {
        format!("{}{}{index:03}", self.prefix, keys::ANNOTATION_CHUNK)
    }

    /// Inverse of [`MetadataCodec::flatten`]: chunks must run `-000`, `-001`, … without a gap
    /// and decode to a JSON object of strings. Keys of other prefixes are kept as labels.
    pub fn unflatten(
        &self,
        flat: &BTreeMap<String, String>,
    ) -> Result<ExecutorMetadata, MetadataError> {
        let chunk_prefix = self.key(keys::ANNOTATION_CHUNK);
        let mut labels = BTreeMap::new();
        let mut chunks = Vec::new();
        for (key, value) in flat {
            match key.strip_prefix(&chunk_prefix) {
                Some(_) => chunks.push((key, value)),
                None => {
                    labels.insert(key.clone(), value.clone());
                }
            }
        }
        if chunks.is_empty() {
            return Err(MetadataError::Chunks("none present"));
        }
        // BTreeMap order is the zero-padded index order.
        let mut encoded = String::new();
        for (index, (key, value)) in chunks.into_iter().enumerate() {
            if *key != self.chunk_key(index) {
                return Err(MetadataError::Chunks(
                    "not a gapless -000, -001, … sequence",
                ));
            }
            encoded.push_str(value);
        }
        let json = URL_SAFE_NO_PAD
            .decode(encoded.as_bytes())
            .map_err(|_| MetadataError::Chunks("not base64url"))?;
        let annotations: BTreeMap<String, String> = serde_json::from_slice(&json)
            .map_err(|_| MetadataError::Chunks("not a JSON object of strings"))?;
        Ok(ExecutorMetadata {
            labels,
            annotations,
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn assignment() -> RecoveredAssignment {
        let td = TrustDomain::new("example.org").unwrap();
        let identity = Identity::from_metadata(
            "octo-org/hello-world",
            "build",
            None,
            "spiffe://example.org/ci/octo-org/hello-world/build",
            &td,
        )
        .unwrap();
        RecoveredAssignment::new(
            AssignmentId::from_task_id(42).unwrap(),
            Backend::Pod,
            identity,
        )
    }

    fn td() -> TrustDomain {
        TrustDomain::new("example.org").unwrap()
    }

    #[test]
    fn encoded_metadata_carries_the_go_versions_keys_and_decodes_back() {
        let codec = MetadataCodec::default();
        let metadata = codec.encode(&assignment());
        assert_eq!(
            metadata.labels,
            BTreeMap::from([
                ("ci.ddupan.top/runner".to_owned(), "true".to_owned()),
                (
                    "ci.ddupan.top/assignment-id".to_owned(),
                    "gitea-task-42".to_owned()
                ),
                ("ci.ddupan.top/task-id".to_owned(), "42".to_owned()),
                ("ci.ddupan.top/backend".to_owned(), "pod".to_owned()),
            ])
        );
        assert_eq!(
            metadata.annotations["ci.ddupan.top/spiffe-id"],
            "spiffe://example.org/ci/octo-org/hello-world/build"
        );
        assert!(metadata.labels.values().all(|v| is_label_value(v)));
        assert_eq!(codec.decode(&metadata, &td()).unwrap(), assignment());
    }

    #[test]
    fn metadata_naming_another_identity_or_task_is_refused() {
        let codec = MetadataCodec::default();
        let mut metadata = codec.encode(&assignment());
        metadata.annotations.insert(
            "ci.ddupan.top/spiffe-id".into(),
            "spiffe://example.org/ci/other/repo/deploy".into(),
        );
        assert!(matches!(
            codec.decode(&metadata, &td()),
            Err(MetadataError::Identity(
                IdentityError::SpiffeIdMismatch { .. }
            ))
        ));
        let mut metadata = codec.encode(&assignment());
        metadata
            .labels
            .insert("ci.ddupan.top/task-id".into(), "43".into());
        assert!(matches!(
            codec.decode(&metadata, &td()),
            Err(MetadataError::AssignmentIdMismatch { .. })
        ));
    }

    #[test]
    fn markers_are_labels_under_the_prefix() {
        let codec = MetadataCodec::new("ci.example.org/").unwrap();
        let mut labels = BTreeMap::new();
        assert!(!codec.has_marker(&labels, Marker::Terminal));
        let (k, v) = codec.marker(Marker::Terminal);
        assert_eq!(
            (k.as_str(), v.as_str()),
            ("ci.example.org/terminal", "true")
        );
        labels.insert(k, v);
        assert!(codec.has_marker(&labels, Marker::Terminal));
        assert!(!codec.has_marker(&labels, Marker::Claimed));
        assert_eq!(codec.runner_selector(), "ci.example.org/runner=true");
    }

    #[test]
    fn annotation_chunks_match_the_go_encoding() {
        // base64url(json.Marshal(map)) of the Go version, cut every 63 characters.
        let codec = MetadataCodec::default();
        let metadata = ExecutorMetadata {
            labels: BTreeMap::new(),
            annotations: BTreeMap::from([("a/b".to_owned(), "c/d".to_owned())]),
        };
        let flat = codec.flatten(&metadata).unwrap();
        assert_eq!(
            flat,
            BTreeMap::from([(
                "ci.ddupan.top/annotations-000".to_owned(),
                URL_SAFE_NO_PAD.encode(br#"{"a/b":"c/d"}"#)
            )])
        );
    }

    #[test]
    fn chunks_cut_anywhere_by_the_go_version_are_read() {
        let codec = MetadataCodec::default();
        let metadata = codec.encode(&assignment());
        let ours = codec.flatten(&metadata).unwrap();
        let joined: String = ours
            .iter()
            .filter(|(k, _)| k.contains(keys::ANNOTATION_CHUNK))
            .map(|(_, v)| v.as_str())
            .collect();
        let mut go = metadata.labels.clone();
        for (i, chunk) in joined.as_bytes().chunks(MAX_LABEL_VALUE).enumerate() {
            go.insert(
                format!("ci.ddupan.top/annotations-{i:03}"),
                String::from_utf8(chunk.to_vec()).unwrap(),
            );
        }
        assert_eq!(codec.unflatten(&go).unwrap(), metadata);
    }

    #[test]
    fn gaps_and_garbage_in_annotation_chunks_are_refused() {
        let codec = MetadataCodec::default();
        let mut flat = codec.flatten(&codec.encode(&assignment())).unwrap();
        assert!(
            flat.len() > 5,
            "the identity annotations need several chunks"
        );
        flat.remove("ci.ddupan.top/annotations-001");
        assert!(matches!(
            codec.unflatten(&flat),
            Err(MetadataError::Chunks(_))
        ));
        let flat = BTreeMap::from([("ci.ddupan.top/annotations-000".to_owned(), "!!".to_owned())]);
        assert!(codec.unflatten(&flat).is_err());
        assert!(codec.unflatten(&BTreeMap::new()).is_err());
    }

    #[test]
    fn prefixes_must_be_a_dns_subdomain_and_a_slash() {
        for good in ["ci.ddupan.top/", "example.org/", "a/"] {
            assert!(MetadataCodec::new(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "/",
            "ci.ddupan.top",
            "CI.example/",
            "-a.b/",
            "a..b/",
            "a b/",
        ] {
            assert!(MetadataCodec::new(bad).is_err(), "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn flattened_metadata_round_trips_and_every_value_is_a_label_value(
            labels in proptest::collection::btree_map("ci\\.ddupan\\.top/[a-z]{1,8}", "[a-z0-9]{0,10}", 0..4),
            annotations in proptest::collection::btree_map("[ -~]{1,40}", "\\PC{0,300}", 0..6),
        ) {
            let codec = MetadataCodec::default();
            let metadata = ExecutorMetadata { labels, annotations };
            let flat = codec.flatten(&metadata).unwrap();
            for (key, value) in &flat {
                if key.contains(keys::ANNOTATION_CHUNK) {
                    prop_assert!(is_label_value(value), "{value:?}");
                }
            }
            prop_assert_eq!(codec.unflatten(&flat).unwrap(), metadata);
        }
    }
}
