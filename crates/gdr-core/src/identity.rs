//! Workload identity of a job (DESIGN invariant 13).
//!
//! The SPIFFE ID is `spiffe://<trust domain>/ci/<owner>/<repo>/<job key>`. It is derived only
//! from what Gitea handed out: the `repository` of the task context and the `jobs:` key of
//! the task's workflow. Nothing in the workflow can choose or override it. The derivation is
//! part of the compatibility contract with the Go seed deployment: recovered backend
//! metadata and running SPIRE entries carry IDs computed the same way.

use std::fmt;
use std::str::FromStr;

use aws_lc_rs::digest;
use gdr_proto::runner::v1::Task;

use super::workflow::{SingleJob, WorkflowError, parse_single_job};

/// Longest slug kept from an unsafe path segment before the digest suffix is added.
const MAX_SLUG_BYTES: usize = 48;

/// Longest SPIFFE ID the SPIFFE specification allows (its URI form, in bytes); SPIRE, the
/// `spiffe` crate and the executor refuse longer ones.
pub const MAX_SPIFFE_ID_BYTES: usize = 2048;

/// A SPIFFE trust domain such as `ddupan.top`.
///
/// Validated on construction (lowercase letters, digits, `.`, `-`, `_`, at most 255 bytes:
/// the SPIFFE trust-domain grammar), so an ID built from it is well formed.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct TrustDomain(String);

/// A trust domain that does not follow the SPIFFE grammar.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid trust domain {0:?}: expected 1-255 characters of lowercase letters, digits, '.', '-' or '_' (e.g. \"example.org\")"
)]
pub struct InvalidTrustDomain(pub String);

impl TrustDomain {
    /// Validates `value` as it is; callers trim configuration input themselves.
    pub fn new(value: impl Into<String>) -> Result<Self, InvalidTrustDomain> {
        let value = value.into();
        let valid = !value.is_empty()
            && value.len() <= 255
            && value.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_')
            });
        if valid {
            Ok(Self(value))
        } else {
            Err(InvalidTrustDomain(value))
        }
    }

    /// The trust domain name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TrustDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for TrustDomain {
    type Err = InvalidTrustDomain;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl TryFrom<String> for TrustDomain {
    type Error = InvalidTrustDomain;

    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl From<TrustDomain> for String {
    fn from(value: TrustDomain) -> Self {
        value.0
    }
}

/// Why no identity could be derived or recovered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The task context has no string `repository`.
    #[error("task context has no repository")]
    MissingRepository,
    /// `repository` is not `owner/repo`.
    #[error("invalid repository {0:?}: expected \"owner/repo\"")]
    InvalidRepository(String),
    /// The job key cannot be a SPIFFE path segment.
    #[error("invalid job key {0:?}: must match ^[A-Za-z_][A-Za-z0-9_-]*$")]
    InvalidJobKey(String),
    /// The task's workflow could not be read.
    #[error("task workflow: {0}")]
    Workflow(#[from] WorkflowError),
    /// The SPIFFE ID repository and job key derive would not be a valid job SPIFFE ID
    /// (a `.`/`..` path segment, or longer than [`MAX_SPIFFE_ID_BYTES`]): no executor could
    /// use it, so the job is refused when its assignment is built.
    #[error("the job's SPIFFE ID would be invalid: {0}")]
    InvalidSpiffeId(#[source] InvalidJobSpiffeId),
    /// Recovered metadata names a SPIFFE ID other than the one its fields derive.
    #[error("recovered SPIFFE ID {found:?} does not match the derived {expected:?}")]
    SpiffeIdMismatch {
        /// The ID found in metadata.
        found: String,
        /// The ID derived from repository and job key.
        expected: String,
    },
}

/// The trusted identity of one job.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    repository: String,
    job_key: String,
    spiffe_id: String,
}

impl Identity {
    /// Derives the identity of `task`: repository from the task context (as Gitea set it),
    /// job key from the single `jobs:` key of its workflow payload.
    pub fn from_task(task: &Task, trust_domain: &TrustDomain) -> Result<Self, IdentityError> {
        let job = parse_single_job(task.workflow_payload.as_deref().unwrap_or_default())?;
        Self::from_task_job(task, &job, trust_domain)
    }

    /// As [`Identity::from_task`], for a caller that has already parsed the workflow.
    pub(crate) fn from_task_job(
        task: &Task,
        job: &SingleJob,
        trust_domain: &TrustDomain,
    ) -> Result<Self, IdentityError> {
        let repository = task
            .context
            .as_option()
            .and_then(|context| context.get("repository"))
            .and_then(|value| value.as_str())
            .ok_or(IdentityError::MissingRepository)?;
        // The Go seed trims here (and only here); identical trimming keeps recomputed
        // identities equal to the ones it stored.
        Self::derive(repository.trim(), &job.key, trust_domain)
    }

    /// Re-validates identity fields recovered from backend metadata: the SPIFFE ID must be
    /// exactly the one `repository` and `job_key` derive, so metadata cannot name another.
    pub fn from_metadata(
        repository: &str,
        job_key: &str,
        spiffe_id: &str,
        trust_domain: &TrustDomain,
    ) -> Result<Self, IdentityError> {
        let identity = Self::derive(repository, job_key, trust_domain)?;
        if identity.spiffe_id != spiffe_id {
            return Err(IdentityError::SpiffeIdMismatch {
                found: spiffe_id.to_owned(),
                expected: identity.spiffe_id,
            });
        }
        Ok(identity)
    }

    fn derive(
        repository: &str,
        job_key: &str,
        trust_domain: &TrustDomain,
    ) -> Result<Self, IdentityError> {
        let (owner, repo) = split_repository(repository)?;
        if !is_job_key(job_key) {
            return Err(IdentityError::InvalidJobKey(job_key.to_owned()));
        }
        let spiffe_id = format!(
            "spiffe://{trust_domain}/ci/{}/{}/{job_key}",
            sanitize(owner),
            sanitize(repo)
        );
        // `sanitize` keeps `.` and `..` (as the Go version did) and nothing bounds the
        // length of names and job keys: check the whole ID now, not when an executor
        // fails to parse it at the start deadline.
        check_job_spiffe_id(&spiffe_id, trust_domain).map_err(IdentityError::InvalidSpiffeId)?;
        Ok(Self {
            repository: repository.to_owned(),
            job_key: job_key.to_owned(),
            spiffe_id,
        })
    }

    /// `owner/repo`.
    pub fn repository(&self) -> &str {
        &self.repository
    }

    /// The workflow `jobs:` key.
    pub fn job_key(&self) -> &str {
        &self.job_key
    }

    /// `spiffe://<td>/ci/<owner>/<repo>/<job key>`.
    pub fn spiffe_id(&self) -> &str {
        &self.spiffe_id
    }
}

fn split_repository(repository: &str) -> Result<(&str, &str), IdentityError> {
    match repository.split_once('/') {
        Some((owner, repo)) if !owner.is_empty() && !repo.is_empty() && !repo.contains('/') => {
            Ok((owner, repo))
        }
        _ => Err(IdentityError::InvalidRepository(repository.to_owned())),
    }
}

/// `^[A-Za-z_][A-Za-z0-9_-]*$`: a job key usable verbatim as a SPIFFE path segment.
fn is_job_key(key: &str) -> bool {
    let mut bytes = key.bytes();
    bytes
        .next()
        .is_some_and(|first| first.is_ascii_alphabetic() || first == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn is_safe_segment_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')
}

/// Turns an owner or repository name into a SPIFFE path segment, exactly as the Go seed did
/// (the IDs are part of the compatibility contract).
///
/// A name matching `^[A-Za-z0-9._-]+$` is kept. Otherwise every run of other characters
/// becomes `-`, `-._` are trimmed from both ends, the slug is cut to 48 bytes (and trimmed
/// again), an empty slug becomes `segment`, and `-` plus the first 12 hex digits of the
/// SHA-256 of the *original* name are appended, so distinct names never share a slug.
/// (Gitea forbids the names `.` and `..`, which this rule would keep.)
pub fn sanitize(segment: &str) -> String {
    if !segment.is_empty() && segment.bytes().all(is_safe_segment_byte) {
        return segment.to_owned();
    }
    let mut slug = String::with_capacity(segment.len());
    let mut in_run = false;
    for c in segment.chars() {
        if c.is_ascii() && is_safe_segment_byte(c as u8) {
            slug.push(c);
            in_run = false;
        } else if !in_run {
            slug.push('-');
            in_run = true;
        }
    }
    let trim = |s: &str| s.trim_matches(['-', '.', '_']).to_owned();
    let mut slug = trim(&slug);
    if slug.len() > MAX_SLUG_BYTES {
        // Only ASCII is left in the slug, so any byte index is a char boundary.
        slug = slug[..MAX_SLUG_BYTES]
            .trim_end_matches(['-', '.', '_'])
            .to_owned();
    }
    if slug.is_empty() {
        slug = "segment".to_owned();
    }
    let digest = digest::digest(&digest::SHA256, segment.as_bytes());
    let hex: String = digest
        .as_ref()
        .iter()
        .take(6)
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{slug}-{hex}")
}

/// A SPIFFE ID that is not the ID of a job in the trust domain.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} is not a job SPIFFE ID of trust domain {trust_domain}: {why}", shown(.id))]
pub struct InvalidJobSpiffeId {
    /// The ID checked.
    pub id: String,
    /// The trust domain it had to belong to.
    pub trust_domain: String,
    /// What is wrong.
    pub why: &'static str,
}

/// The ID as an error shows it: quoted, and cut after 120 bytes (an over-long ID would
/// otherwise fill the log row Gitea shows the user).
fn shown(id: &str) -> String {
    const SHOWN: usize = 120;
    if id.len() <= SHOWN {
        return format!("{id:?}");
    }
    let mut end = SHOWN;
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}… ({} bytes)", &id[..end], id.len())
}

/// Checks that `spiffe_id` has the shape every job identity has,
/// `spiffe://<trust domain>/ci/<owner>/<repo>/<job key>`: owner and repo are path segments
/// [`sanitize`] can produce (`[A-Za-z0-9._-]+`, not `.` or `..`) and the job key matches
/// `[A-Za-z_][A-Za-z0-9_-]*`. For an ID that arrives without the repository and job key
/// it was derived from (a sandbox's `CI_SPIFFE_ID`); [`Identity::from_metadata`] checks more
/// where those are known. At most [`MAX_SPIFFE_ID_BYTES`] long, as the SPIFFE
/// specification requires.
pub fn check_job_spiffe_id(
    spiffe_id: &str,
    trust_domain: &TrustDomain,
) -> Result<(), InvalidJobSpiffeId> {
    let fail = |why| {
        Err(InvalidJobSpiffeId {
            id: spiffe_id.to_owned(),
            trust_domain: trust_domain.as_str().to_owned(),
            why,
        })
    };
    if spiffe_id.len() > MAX_SPIFFE_ID_BYTES {
        return fail("it is longer than the 2048 bytes a SPIFFE ID may have");
    }
    let prefix = format!("spiffe://{trust_domain}/ci/");
    let Some(path) = spiffe_id.strip_prefix(&prefix) else {
        return fail("it is outside the trust domain's /ci/ namespace");
    };
    let segments: Vec<&str> = path.split('/').collect();
    let [owner, repo, job_key] = segments.as_slice() else {
        return fail("the path is not /ci/<owner>/<repo>/<job key>");
    };
    for segment in [owner, repo] {
        if segment.is_empty()
            || matches!(*segment, "." | "..")
            || !segment.bytes().all(is_safe_segment_byte)
        {
            return fail("owner and repo must be [A-Za-z0-9._-]+ segments");
        }
    }
    if !is_job_key(job_key) {
        return fail("the job key must match [A-Za-z_][A-Za-z0-9_-]*");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use buffa_types::google::protobuf::{Struct, Value};
    use proptest::prelude::*;

    use super::*;

    fn td() -> TrustDomain {
        TrustDomain::new("ddupan.top").unwrap()
    }

    fn task_with(repository: Option<&str>, payload: &str) -> Task {
        let mut context = Struct::new();
        if let Some(repository) = repository {
            context.insert("repository", Value::from(repository));
        }
        Task {
            id: 900,
            workflow_payload: Some(payload.as_bytes().to_vec()),
            context: context.into(),
            ..Default::default()
        }
    }

    #[test]
    fn sanitize_matches_the_go_seed_vector() {
        assert_eq!(sanitize("Run on Ubuntu"), "Run-on-Ubuntu-8b7cd4c244fb");
    }

    #[test]
    fn safe_segments_are_kept_and_unsafe_ones_never_collide() {
        assert_eq!(sanitize("gitea-dynamic-runner"), "gitea-dynamic-runner");
        assert_eq!(sanitize("a.b_c-D9"), "a.b_c-D9");
        assert_ne!(sanitize("Run on Ubuntu"), sanitize("Run@on Ubuntu"));
        assert!(sanitize("Run@on Ubuntu").starts_with("Run-on-Ubuntu-"));
    }

    #[test]
    fn sanitize_trims_cuts_and_falls_back_like_the_go_seed() {
        // Non-ASCII runs collapse to one '-', ends are trimmed.
        assert!(
            sanitize("  ünï  cödé ").starts_with("n-c-d-"),
            "{}",
            sanitize("  ünï  cödé ")
        );
        // Nothing usable left.
        let s = sanitize("日本");
        assert!(
            s.starts_with("segment-") && s.len() == "segment-".len() + 12,
            "{s}"
        );
        assert!(sanitize("").starts_with("segment-"));
        // Cut to 48 then trimmed again: the '-' at byte 48 is dropped.
        let long = format!("{}  {}", "a".repeat(47), "b".repeat(10));
        let s = sanitize(&long);
        assert_eq!(&s[..48], "a".repeat(47) + "-");
        assert_eq!(s.len(), 47 + 1 + 12);
    }

    #[test]
    fn identity_comes_from_the_task_context_and_the_job_key() {
        let task = task_with(
            Some("panxiao81/gitea-dynamic-runner"),
            "jobs:\n  publish-images:\n    name: Publish images\n    runs-on: [self-hosted, vm]\n    steps: []\n",
        );
        let identity = Identity::from_task(&task, &td()).unwrap();
        assert_eq!(identity.repository(), "panxiao81/gitea-dynamic-runner");
        assert_eq!(identity.job_key(), "publish-images");
        assert_eq!(
            identity.spiffe_id(),
            "spiffe://ddupan.top/ci/panxiao81/gitea-dynamic-runner/publish-images"
        );
    }

    #[test]
    fn unsafe_owner_and_repo_names_are_slugged_in_the_spiffe_id() {
        let task = task_with(
            Some("My Org/Run on Ubuntu"),
            "jobs:\n  a:\n    runs-on: self-hosted\n",
        );
        let identity = Identity::from_task(&task, &td()).unwrap();
        assert_eq!(identity.repository(), "My Org/Run on Ubuntu");
        assert_eq!(
            identity.spiffe_id(),
            format!(
                "spiffe://ddupan.top/ci/{}/Run-on-Ubuntu-8b7cd4c244fb/a",
                sanitize("My Org")
            )
        );
    }

    #[test]
    fn a_job_key_that_is_not_a_safe_path_segment_is_rejected() {
        for key in ["'Run on Ubuntu'", "'9lives'", "'a.b'", "'-x'"] {
            let task = task_with(
                Some("owner/repo"),
                &format!("jobs:\n  {key}:\n    runs-on: self-hosted\n"),
            );
            assert!(
                matches!(
                    Identity::from_task(&task, &td()),
                    Err(IdentityError::InvalidJobKey(_))
                ),
                "{key}"
            );
        }
    }

    #[test]
    fn an_incomplete_repository_in_the_task_context_is_rejected() {
        for repository in ["invalid", "", "/repo", "owner/", "a/b/c"] {
            let task = task_with(
                Some(repository),
                "jobs:\n  test:\n    runs-on: self-hosted\n",
            );
            assert!(
                matches!(
                    Identity::from_task(&task, &td()),
                    Err(IdentityError::InvalidRepository(_))
                ),
                "{repository:?}"
            );
        }
        let task = task_with(None, "jobs:\n  test:\n    runs-on: self-hosted\n");
        assert_eq!(
            Identity::from_task(&task, &td()),
            Err(IdentityError::MissingRepository)
        );
        let mut task = task_with(None, "jobs:\n  test:\n    runs-on: self-hosted\n");
        task.context = Default::default();
        assert_eq!(
            Identity::from_task(&task, &td()),
            Err(IdentityError::MissingRepository)
        );
    }

    #[test]
    fn recovered_metadata_must_carry_exactly_the_derived_spiffe_id() {
        let identity = Identity::from_metadata(
            "owner/repo",
            "publish",
            "spiffe://ddupan.top/ci/owner/repo/publish",
            &td(),
        )
        .unwrap();
        assert_eq!(identity.job_key(), "publish");
        for (repository, key, id) in [
            (
                "owner/repo",
                "publish",
                "spiffe://ddupan.top/ci/owner/repo/other",
            ),
            (
                "owner/repo",
                "publish",
                "spiffe://evil.org/ci/owner/repo/publish",
            ),
            (
                "owner",
                "publish",
                "spiffe://ddupan.top/ci/owner/repo/publish",
            ),
            (
                "owner/repo",
                "Publish images",
                "spiffe://ddupan.top/ci/owner/repo/Publish images",
            ),
        ] {
            assert!(
                Identity::from_metadata(repository, key, id, &td()).is_err(),
                "{repository} {key} {id}"
            );
        }
    }

    #[test]
    fn trust_domains_follow_the_spiffe_grammar() {
        for good in ["ddupan.top", "example.org", "td_1-x"] {
            assert!(TrustDomain::new(good).is_ok(), "{good}");
        }
        for bad in ["", "a/b", "a b", "Example.org", " ddupan.top", "spiffe://x"] {
            assert!(TrustDomain::new(bad).is_err(), "{bad:?}");
        }
        let td: TrustDomain = serde_json::from_str("\"ddupan.top\"").unwrap();
        assert_eq!(td.as_str(), "ddupan.top");
        assert!(serde_json::from_str::<TrustDomain>("\"Bad Domain\"").is_err());
    }

    proptest! {
        #[test]
        fn every_sanitized_segment_is_a_safe_spiffe_path_segment(segment in ".{0,80}") {
            let out = sanitize(&segment);
            prop_assert!(!out.is_empty() && out.bytes().all(is_safe_segment_byte), "{out:?}");
            prop_assert!(out.len() <= segment.len().max(MAX_SLUG_BYTES + 13));
            if out != segment {
                // Only unsafe input is rewritten, and it always carries its digest.
                prop_assert!(!segment.bytes().all(is_safe_segment_byte) || segment.is_empty());
                prop_assert_eq!(out.as_bytes()[out.len() - 13], b'-');
            }
        }
    }

    #[test]
    fn job_spiffe_ids_are_checked_by_shape_and_trust_domain() {
        let td = TrustDomain::new("example.org").unwrap();
        for good in [
            "spiffe://example.org/ci/octo-org/hello-world/build",
            "spiffe://example.org/ci/o/Run-on-Ubuntu-8b7cd4c244fb/_job-1",
        ] {
            assert_eq!(check_job_spiffe_id(good, &td), Ok(()), "{good}");
        }
        for bad in [
            "spiffe://evil.org/ci/o/r/build",
            "spiffe://example.org/ops/o/r/build",
            "spiffe://example.org/ci/o/r",
            "spiffe://example.org/ci/o/r/build/extra",
            "spiffe://example.org/ci/o/../build",
            "spiffe://example.org/ci/o/r r/build",
            "spiffe://example.org/ci//r/build",
            "spiffe://example.org/ci/o/r/1build",
            "spiffe://example.org.evil/ci/o/r/build",
        ] {
            assert!(check_job_spiffe_id(bad, &td).is_err(), "{bad}");
        }
        let long = format!("spiffe://example.org/ci/o/r/{}", "j".repeat(2048));
        assert!(check_job_spiffe_id(&long, &td).is_err(), "over 2048 bytes");
    }

    /// DESIGN invariant 13: a repository or job name that would derive an unusable SPIFFE
    /// ID (a dot segment, more than 2048 bytes) makes no identity, so the job is refused
    /// with the reason when its assignment is built instead of failing at the start
    /// deadline in an executor that cannot parse its own ID.
    #[test]
    fn names_that_derive_an_unusable_spiffe_id_make_no_identity() {
        let job = |key: &str| format!("jobs:\n  {key}:\n    runs-on: [self-hosted, pod]\n");
        for (repository, key, why) in [
            ("./repo", "build".to_owned(), "owner and repo"),
            ("owner/..", "build".to_owned(), "owner and repo"),
            // YAML caps implicit keys at 1024 characters; a long name does the rest.
            (
                &format!("owner/{}", "r".repeat(1100)),
                "j".repeat(1000),
                "2048 bytes",
            ),
            (
                &format!("owner/{}", "r".repeat(2100)),
                "build".to_owned(),
                "2048 bytes",
            ),
        ] {
            let err = Identity::from_task(&task_with(Some(repository), &job(&key)), &td())
                .expect_err(repository);
            assert!(
                matches!(err, IdentityError::InvalidSpiffeId(_)),
                "{repository}: {err}"
            );
            let text = err.to_string();
            assert!(text.contains(why), "{text}");
            assert!(
                text.len() < 400,
                "the reason stays short: {} bytes",
                text.len()
            );
        }
        let repo = "r".repeat(2048 - "spiffe://ddupan.top/ci/o//build".len());
        Identity::from_task(&task_with(Some(&format!("o/{repo}")), &job("build")), &td())
            .expect("an ID of exactly 2048 bytes is valid");
    }
}
