//! Workload identity of a job (DESIGN invariant 13).
//!
//! Two schemes name a job, chosen by the operator (`spiffe_id_scheme`):
//!
//! - **ref** (the default): `spiffe://<td>/ci/<owner>/<repo>/<ref kind>/<ref name>/<job key>`,
//!   where the ref is what the job runs for, as Gitea put it in the task context: `branch`
//!   (`refs/heads/…`), `tag` (`refs/tags/…`), `pull` (a pull request, named by its number)
//!   or `ref` (any other ref, named in full). The job key is chosen by whoever writes the
//!   workflow, which includes the author of a pull request and anyone who can push a
//!   branch; the ref is not (a branch can be protected, a pull request's number is Gitea's),
//!   so only this scheme lets a resource server tell the deploy job of `main` from a job of
//!   the same name in a pull request. Like GitHub's OIDC `sub`
//!   (`repo:o/r:ref:refs/heads/main`, `repo:o/r:pull_request`).
//! - **job**: `spiffe://<td>/ci/<owner>/<repo>/<job key>`, the Go seed's derivation, kept for
//!   a takeover of its deployment (its queued envelopes, recovered metadata and running
//!   SPIRE entries carry IDs computed this way). Every run of a job key shares one ID.
//!
//! Either way the ID is derived only from what Gitea handed out: the `repository` (and for
//! the ref scheme `ref`, `event_name`, `head_ref` and the event's pull request number) of
//! the task context and the single `jobs:` key of the task's workflow.

use std::fmt;
use std::str::FromStr;

use aws_lc_rs::digest;
use buffa_types::google::protobuf::{Struct, Value};
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

/// How job SPIFFE IDs are formed (`spiffe_id_scheme`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum IdentityScheme {
    /// `…/ci/<owner>/<repo>/<ref kind>/<ref name>/<job key>`: the ID names what the job runs
    /// for, so a pull request's job never has a branch's identity.
    #[default]
    Ref,
    /// `…/ci/<owner>/<repo>/<job key>`, the Go seed's: every run of a job key, pull requests
    /// and unprotected branches included, has the same identity.
    Job,
}

impl IdentityScheme {
    /// The setting's spelling: `ref` or `job`.
    pub fn as_str(self) -> &'static str {
        match self {
            IdentityScheme::Ref => "ref",
            IdentityScheme::Job => "job",
        }
    }
}

impl fmt::Display for IdentityScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Neither `ref` nor `job`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid SPIFFE ID scheme {0:?}: expected \"ref\" or \"job\"")]
pub struct InvalidIdentityScheme(pub String);

impl FromStr for IdentityScheme {
    type Err = InvalidIdentityScheme;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ref" => Ok(IdentityScheme::Ref),
            "job" => Ok(IdentityScheme::Job),
            other => Err(InvalidIdentityScheme(other.to_owned())),
        }
    }
}

/// What kind of ref a job runs for: the path segment after the repository.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RefKind {
    /// `refs/heads/<name>`: named by the branch.
    Branch,
    /// `refs/tags/<name>`: named by the tag.
    Tag,
    /// A pull request (`refs/pull/<n>/…`, or a `pull_request_target` run): named by its number.
    Pull,
    /// Any other ref: named by the whole ref.
    Other,
}

impl RefKind {
    const ALL: [RefKind; 4] = [RefKind::Branch, RefKind::Tag, RefKind::Pull, RefKind::Other];

    /// The path segment: `branch`, `tag`, `pull` or `ref`.
    pub fn as_str(self) -> &'static str {
        match self {
            RefKind::Branch => "branch",
            RefKind::Tag => "tag",
            RefKind::Pull => "pull",
            RefKind::Other => "ref",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|kind| kind.as_str() == text)
    }
}

/// What a job runs for, as its SPIFFE ID names it under [`IdentityScheme::Ref`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct JobRef {
    kind: RefKind,
    /// The branch or tag name, the pull request number, or the whole ref; not sanitized.
    name: String,
}

const EVENT_PULL_REQUEST_TARGET: &str = "pull_request_target";

impl JobRef {
    /// What the task context says the job runs for.
    ///
    /// `ref` is required: a task without it is given no identity (a weaker one would let it
    /// pass for a branch). A run for a pull request is `pull/<number>` whatever its `ref`:
    /// for `pull_request` Gitea sets `ref` to `refs/pull/<n>/head`; for
    /// `pull_request_target` it runs the base branch's workflow and rewrites `ref` to the
    /// base branch (`services/actions/context.go`), yet the run is started by the pull
    /// request's author and such workflows are written to handle the pull request's code,
    /// so it must not hold the base branch's identity. Such a run is recognised by its
    /// `event_name` or, in a reusable workflow it calls (whose `event_name` Gitea makes
    /// `workflow_call`), by the `head_ref` Gitea sets only for pull request events; its
    /// number is the event's `pull_request.number` (or `number`).
    pub fn from_context(context: Option<&Struct>) -> Result<Self, IdentityError> {
        let field = |name: &str| {
            context
                .and_then(|c| c.get(name))
                .and_then(Value::as_str)
                .unwrap_or_default()
        };
        let git_ref = field("ref");
        if git_ref.is_empty() {
            return Err(IdentityError::MissingRef);
        }
        let invalid = || IdentityError::InvalidRef(git_ref.to_owned());
        if let Some(rest) = git_ref.strip_prefix("refs/pull/") {
            let number = rest.split('/').next().unwrap_or_default();
            return if is_pull_number(number) {
                Ok(Self::new(RefKind::Pull, number))
            } else {
                Err(invalid())
            };
        }
        let event_name = field("event_name");
        if event_name == EVENT_PULL_REQUEST_TARGET || !field("head_ref").is_empty() {
            let event = context
                .and_then(|c| c.get("event"))
                .and_then(Value::as_struct);
            let number = event
                .and_then(|e| e.get("pull_request"))
                .and_then(Value::as_struct)
                .and_then(|pr| pr.get("number"))
                .or_else(|| event.and_then(|e| e.get("number")))
                .and_then(Value::as_number)
                .and_then(pull_number_of);
            return number
                .map(|n| Self::new(RefKind::Pull, &n.to_string()))
                .ok_or_else(|| IdentityError::MissingPullRequestNumber {
                    event_name: event_name.to_owned(),
                });
        }
        let (kind, name) = if let Some(branch) = git_ref.strip_prefix("refs/heads/") {
            (RefKind::Branch, branch)
        } else if let Some(tag) = git_ref.strip_prefix("refs/tags/") {
            (RefKind::Tag, tag)
        } else {
            (RefKind::Other, git_ref)
        };
        if name.is_empty() {
            return Err(invalid());
        }
        Ok(Self::new(kind, name))
    }

    fn new(kind: RefKind, name: &str) -> Self {
        JobRef {
            kind,
            name: name.to_owned(),
        }
    }

    /// Parses the metadata form `<kind>:<name>` ([`fmt::Display`]).
    pub fn parse(text: &str) -> Result<Self, IdentityError> {
        let invalid = || IdentityError::InvalidRef(text.to_owned());
        let (kind, name) = text.split_once(':').ok_or_else(invalid)?;
        let kind = RefKind::parse(kind).ok_or_else(invalid)?;
        let valid = match kind {
            RefKind::Pull => is_pull_number(name),
            _ => !name.is_empty(),
        };
        if !valid {
            return Err(invalid());
        }
        Ok(Self::new(kind, name))
    }

    /// The kind of ref.
    pub fn kind(&self) -> RefKind {
        self.kind
    }

    /// The branch or tag name, the pull request number, or the whole ref, as Gitea gave it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `<kind>/<name as one safe segment>`: the part of the SPIFFE ID naming the ref.
    fn path(&self) -> String {
        format!("{}/{}", self.kind.as_str(), sanitize_ref_name(&self.name))
    }
}

impl fmt::Display for JobRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.kind.as_str(), self.name)
    }
}

/// A pull request number as a ref names it: a positive decimal without leading zeros.
fn is_pull_number(text: &str) -> bool {
    !text.is_empty()
        && !text.starts_with('0')
        && text.len() <= 15
        && text.bytes().all(|b| b.is_ascii_digit())
}

/// A pull request number from a JSON number of the event payload.
fn pull_number_of(value: f64) -> Option<u64> {
    // Exactly representable integers only (up to 2^53); Gitea's numbers are int64 indexes.
    const MAX_EXACT: f64 = 9_007_199_254_740_992.0;
    if !(1.0..=MAX_EXACT).contains(&value) || value.fract() != 0.0 {
        return None;
    }
    // In range and integral: the conversion is exact.
    Some(value as u64)
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
    /// The task context has no `ref` (needed by [`IdentityScheme::Ref`]).
    #[error(
        "task context has no ref: the job's SPIFFE ID names the branch, tag or pull request it runs for, so a task without one gets no identity"
    )]
    MissingRef,
    /// `ref` (of the task context, or of recovered metadata) names nothing usable.
    #[error(
        "invalid ref {0:?}: expected refs/heads/<branch>, refs/tags/<tag>, refs/pull/<number>/… or another full ref"
    )]
    InvalidRef(String),
    /// A pull request's task whose context names no pull request number.
    #[error(
        "task context of a pull request run (event_name {event_name:?}) has no pull request number: its ref is not refs/pull/<number>/… and its event has no pull_request.number"
    )]
    MissingPullRequestNumber {
        /// The context's `event_name`.
        event_name: String,
    },
    /// The job key cannot be a SPIFFE path segment.
    #[error("invalid job key {0:?}: must match ^[A-Za-z_][A-Za-z0-9_-]*$")]
    InvalidJobKey(String),
    /// The task's workflow could not be read.
    #[error("task workflow: {0}")]
    Workflow(#[from] WorkflowError),
    /// The SPIFFE ID the task derives would not be a valid job SPIFFE ID (a `.`/`..` path
    /// segment, or longer than [`MAX_SPIFFE_ID_BYTES`]): no executor could use it, so the
    /// job is refused when its assignment is built.
    #[error("the job's SPIFFE ID would be invalid: {0}")]
    InvalidSpiffeId(#[source] InvalidJobSpiffeId),
    /// Recovered metadata names a SPIFFE ID other than the one its fields derive.
    #[error("recovered SPIFFE ID {found:?} does not match the derived {expected:?}")]
    SpiffeIdMismatch {
        /// The ID found in metadata.
        found: String,
        /// The ID derived from repository, ref and job key.
        expected: String,
    },
}

/// The trusted identity of one job.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    repository: String,
    job_key: String,
    /// `None` under [`IdentityScheme::Job`].
    job_ref: Option<JobRef>,
    spiffe_id: String,
}

impl Identity {
    /// Derives the identity of `task` under `scheme`: repository (and ref) from the task
    /// context as Gitea set it, job key from the single `jobs:` key of its workflow payload.
    pub fn from_task(
        task: &Task,
        trust_domain: &TrustDomain,
        scheme: IdentityScheme,
    ) -> Result<Self, IdentityError> {
        let job = parse_single_job(task.workflow_payload.as_deref().unwrap_or_default())?;
        Self::from_task_job(task, &job, trust_domain, scheme)
    }

    /// As [`Identity::from_task`], for a caller that has already parsed the workflow.
    pub(crate) fn from_task_job(
        task: &Task,
        job: &SingleJob,
        trust_domain: &TrustDomain,
        scheme: IdentityScheme,
    ) -> Result<Self, IdentityError> {
        let context = task.context.as_option();
        let repository = context
            .and_then(|context| context.get("repository"))
            .and_then(|value| value.as_str())
            .ok_or(IdentityError::MissingRepository)?;
        let job_ref = match scheme {
            IdentityScheme::Ref => Some(JobRef::from_context(context)?),
            IdentityScheme::Job => None,
        };
        // The Go seed trims here (and only here); identical trimming keeps recomputed
        // identities equal to the ones it stored.
        Self::derive(repository.trim(), &job.key, job_ref, trust_domain)
    }

    /// Re-validates identity fields recovered from backend metadata: the SPIFFE ID must be
    /// exactly the one `repository`, `job_ref` (metadata form `<kind>:<name>`; absent for
    /// an identity of the job scheme, such as every one the Go seed recorded) and `job_key`
    /// derive, so metadata cannot name another.
    pub fn from_metadata(
        repository: &str,
        job_key: &str,
        job_ref: Option<&str>,
        spiffe_id: &str,
        trust_domain: &TrustDomain,
    ) -> Result<Self, IdentityError> {
        let job_ref = job_ref.map(JobRef::parse).transpose()?;
        let identity = Self::derive(repository, job_key, job_ref, trust_domain)?;
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
        job_ref: Option<JobRef>,
        trust_domain: &TrustDomain,
    ) -> Result<Self, IdentityError> {
        let (owner, repo) = split_repository(repository)?;
        if !is_job_key(job_key) {
            return Err(IdentityError::InvalidJobKey(job_key.to_owned()));
        }
        let (owner, repo) = (sanitize(owner), sanitize(repo));
        let spiffe_id = match &job_ref {
            Some(job_ref) => format!(
                "spiffe://{trust_domain}/ci/{owner}/{repo}/{}/{job_key}",
                job_ref.path()
            ),
            None => format!("spiffe://{trust_domain}/ci/{owner}/{repo}/{job_key}"),
        };
        // `sanitize` keeps `.` and `..` (as the Go version did) and nothing bounds the
        // length of names, refs and job keys: check the whole ID now, not when an executor
        // fails to parse it at the start deadline.
        check_job_spiffe_id(&spiffe_id, trust_domain).map_err(IdentityError::InvalidSpiffeId)?;
        Ok(Self {
            repository: repository.to_owned(),
            job_key: job_key.to_owned(),
            job_ref,
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

    /// What the job runs for; `None` for an identity of [`IdentityScheme::Job`].
    pub fn job_ref(&self) -> Option<&JobRef> {
        self.job_ref.as_ref()
    }

    /// The scheme the SPIFFE ID was formed by.
    pub fn scheme(&self) -> IdentityScheme {
        match self.job_ref {
            Some(_) => IdentityScheme::Ref,
            None => IdentityScheme::Job,
        }
    }

    /// `spiffe://<td>/ci/<owner>/<repo>/<ref kind>/<ref name>/<job key>`, or under the job
    /// scheme `spiffe://<td>/ci/<owner>/<repo>/<job key>`.
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

fn is_safe_segment(segment: &str) -> bool {
    !segment.is_empty() && segment.bytes().all(is_safe_segment_byte)
}

/// Hex digits of the digest [`sanitize`] appends (the Go seed's 48 bits).
const NAME_DIGEST_HEX: usize = 12;
/// Hex digits of the digest [`sanitize_ref_name`] appends: 128 bits, so that nobody who
/// can push a branch can search for a name whose digest matches a protected branch's.
const REF_DIGEST_HEX: usize = 32;

/// Turns an owner or repository name into a SPIFFE path segment, exactly as the Go seed did
/// (the IDs are part of the compatibility contract).
///
/// A name matching `^[A-Za-z0-9._-]+$` is kept. Otherwise every run of other characters
/// becomes `-`, `-._` are trimmed from both ends, the slug is cut to 48 bytes (and trimmed
/// again), an empty slug becomes `segment`, and `-` plus the first 12 hex digits of the
/// SHA-256 of the *original* name are appended, so distinct unsafe names never share a slug.
/// (Gitea forbids the names `.` and `..`, which this rule would keep, and allows no owner
/// or repository name outside `[A-Za-z0-9._-]`, so its names are always kept.)
pub fn sanitize(segment: &str) -> String {
    if is_safe_segment(segment) {
        return segment.to_owned();
    }
    slug_with_digest(segment, NAME_DIGEST_HEX)
}

/// Turns a branch or tag name, or a whole ref, into one SPIFFE path segment, so that no
/// name (`main/x`, `main-x`, …) can pass for another's segment or add segments of its own.
///
/// Kept when it matches `^[A-Za-z0-9._-]+$`, is not `.` or `..`, and does not end like a
/// digest suffix (`-` and 32 lowercase hex digits). Otherwise slugged as [`sanitize`] does,
/// with `-` and 32 hex digits of the SHA-256 of the original name appended. A kept name
/// never ends like a digest suffix and every slugged one does, so a branch that anybody can
/// push, named after another branch's slug, still gets a segment of its own. (`sanitize`'s
/// 12 digits, and its keeping such names, would allow both: branch names are chosen by
/// whoever can push, owner and repository names are not.)
pub fn sanitize_ref_name(name: &str) -> String {
    if is_safe_segment(name) && !matches!(name, "." | "..") && !ends_with_ref_digest(name) {
        return name.to_owned();
    }
    slug_with_digest(name, REF_DIGEST_HEX)
}

/// Whether `name` ends in `-` and [`REF_DIGEST_HEX`] lowercase hex digits.
fn ends_with_ref_digest(name: &str) -> bool {
    let bytes = name.as_bytes();
    bytes.len() > REF_DIGEST_HEX
        && bytes[bytes.len() - REF_DIGEST_HEX - 1] == b'-'
        && bytes[bytes.len() - REF_DIGEST_HEX..]
            .iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
}

/// The slug of `segment` plus `-` and the first `hex_digits` hex digits of its SHA-256.
fn slug_with_digest(segment: &str, hex_digits: usize) -> String {
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
        .take(hex_digits / 2)
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

/// Checks that `spiffe_id` has the shape of a job identity of either scheme,
/// `spiffe://<trust domain>/ci/<owner>/<repo>/<ref kind>/<ref name>/<job key>` or
/// `spiffe://<trust domain>/ci/<owner>/<repo>/<job key>`: owner, repo and ref name are
/// path segments the sanitizers can produce (`[A-Za-z0-9._-]+`, not `.` or `..`), the ref
/// kind is `branch`, `tag`, `pull` or `ref`, and the job key matches
/// `[A-Za-z_][A-Za-z0-9_-]*`. For an ID that arrives without the fields it was derived
/// from (a sandbox's `CI_SPIFFE_ID`); [`Identity::from_metadata`] checks more where those
/// are known. At most [`MAX_SPIFFE_ID_BYTES`] long, as the SPIFFE specification requires.
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
    let (owner, repo, job_ref, job_key) = match segments.as_slice() {
        [owner, repo, job_key] => (owner, repo, None, job_key),
        [owner, repo, kind, name, job_key] => (owner, repo, Some((kind, name)), job_key),
        _ => {
            return fail(
                "the path is not /ci/<owner>/<repo>/<ref kind>/<ref name>/<job key> or /ci/<owner>/<repo>/<job key>",
            );
        }
    };
    let usable = |segment: &str| is_safe_segment(segment) && !matches!(segment, "." | "..");
    if !usable(owner) || !usable(repo) {
        return fail("owner and repo must be [A-Za-z0-9._-]+ segments");
    }
    if let Some((kind, name)) = job_ref {
        if RefKind::parse(kind).is_none() {
            return fail("the ref kind must be branch, tag, pull or ref");
        }
        if !usable(name) {
            return fail("the ref name must be a [A-Za-z0-9._-]+ segment");
        }
    }
    if !is_job_key(job_key) {
        return fail("the job key must match [A-Za-z_][A-Za-z0-9_-]*");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn td() -> TrustDomain {
        TrustDomain::new("ddupan.top").unwrap()
    }

    /// A task of `repository` for a push to `main`.
    fn task_with(repository: Option<&str>, payload: &str) -> Task {
        task_in(
            repository,
            &[("ref", "refs/heads/main"), ("event_name", "push")],
            payload,
        )
    }

    /// A task whose context has `repository` and the string `fields`.
    fn task_in(repository: Option<&str>, fields: &[(&str, &str)], payload: &str) -> Task {
        let mut context = Struct::new();
        if let Some(repository) = repository {
            context.insert("repository", Value::from(repository));
        }
        for (key, value) in fields {
            context.insert(*key, Value::from(*value));
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
        let identity = Identity::from_task(&task, &td(), IdentityScheme::Job).unwrap();
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
        let identity = Identity::from_task(&task, &td(), IdentityScheme::Job).unwrap();
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
                    Identity::from_task(&task, &td(), IdentityScheme::Job),
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
                    Identity::from_task(&task, &td(), IdentityScheme::Job),
                    Err(IdentityError::InvalidRepository(_))
                ),
                "{repository:?}"
            );
        }
        let task = task_with(None, "jobs:\n  test:\n    runs-on: self-hosted\n");
        assert_eq!(
            Identity::from_task(&task, &td(), IdentityScheme::Job),
            Err(IdentityError::MissingRepository)
        );
        let mut task = task_with(None, "jobs:\n  test:\n    runs-on: self-hosted\n");
        task.context = Default::default();
        assert_eq!(
            Identity::from_task(&task, &td(), IdentityScheme::Job),
            Err(IdentityError::MissingRepository)
        );
    }

    #[test]
    fn recovered_metadata_must_carry_exactly_the_derived_spiffe_id() {
        let identity = Identity::from_metadata(
            "owner/repo",
            "publish",
            None,
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
                Identity::from_metadata(repository, key, None, id, &td()).is_err(),
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
            let err = Identity::from_task(
                &task_with(Some(repository), &job(&key)),
                &td(),
                IdentityScheme::Job,
            )
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
        Identity::from_task(
            &task_with(Some(&format!("o/{repo}")), &job("build")),
            &td(),
            IdentityScheme::Job,
        )
        .expect("an ID of exactly 2048 bytes is valid");
    }

    // === the ref scheme ===

    const DEPLOY: &str = "jobs:\n  deploy:\n    runs-on: [self-hosted, pod]\n    steps: []\n";

    fn ref_id(fields: &[(&str, &str)]) -> Result<String, IdentityError> {
        Identity::from_task(
            &task_in(Some("owner/repo"), fields, DEPLOY),
            &td(),
            IdentityScheme::Ref,
        )
        .map(|identity| identity.spiffe_id().to_owned())
    }

    fn push(git_ref: &str) -> Result<String, IdentityError> {
        ref_id(&[("ref", git_ref), ("event_name", "push")])
    }

    /// A task context of a pull request event as Gitea writes it: `event` is the webhook
    /// payload, with the pull request's number.
    fn pull_request_task(event_name: &str, git_ref: &str, number: Option<f64>) -> Task {
        let mut task = task_in(
            Some("owner/repo"),
            &[
                ("ref", git_ref),
                ("event_name", event_name),
                ("base_ref", "main"),
                ("head_ref", "feature"),
            ],
            DEPLOY,
        );
        let mut event = Struct::new();
        if let Some(number) = number {
            let mut pull_request = Struct::new();
            pull_request.insert("number", Value::from(number));
            event.insert("pull_request", pull_request);
            event.insert("number", Value::from(number));
        }
        task.context.as_option_mut().unwrap().insert("event", event);
        task
    }

    /// DESIGN invariant 13: the job key is chosen by whoever writes the workflow, a pull
    /// request's author and anyone who can push a branch included, so under the ref scheme
    /// the same job key run for main, for an unprotected branch and for a pull request has
    /// three identities; only the job scheme (the Go seed's, kept for a takeover) gives
    /// them one.
    #[test]
    fn the_same_job_key_on_main_a_branch_and_a_pull_request_has_three_identities() {
        let main = push("refs/heads/main").unwrap();
        let branch = push("refs/heads/evil").unwrap();
        let pull = ref_id(&[
            ("ref", "refs/pull/7/head"),
            ("event_name", "pull_request"),
            ("head_ref", "evil"),
        ])
        .unwrap();
        assert_eq!(main, "spiffe://ddupan.top/ci/owner/repo/branch/main/deploy");
        assert_eq!(
            branch,
            "spiffe://ddupan.top/ci/owner/repo/branch/evil/deploy"
        );
        assert_eq!(pull, "spiffe://ddupan.top/ci/owner/repo/pull/7/deploy");
        assert_eq!(
            push("refs/tags/v1.2.0").unwrap(),
            "spiffe://ddupan.top/ci/owner/repo/tag/v1.2.0/deploy"
        );
        let other = push("refs/for/main").unwrap();
        assert!(
            other.starts_with("spiffe://ddupan.top/ci/owner/repo/ref/refs-for-main-")
                && other.ends_with("/deploy"),
            "{other}"
        );

        let legacy = |git_ref: &str| {
            Identity::from_task(
                &task_in(Some("owner/repo"), &[("ref", git_ref)], DEPLOY),
                &td(),
                IdentityScheme::Job,
            )
            .unwrap()
            .spiffe_id()
            .to_owned()
        };
        for git_ref in ["refs/heads/main", "refs/heads/evil", "refs/pull/7/head"] {
            assert_eq!(
                legacy(git_ref),
                "spiffe://ddupan.top/ci/owner/repo/deploy",
                "the job scheme cannot tell {git_ref} from main"
            );
        }
    }

    /// DESIGN invariant 13: `pull_request_target` runs the base branch's workflow with `ref`
    /// rewritten to the base branch, but for a pull request and started by its author: it
    /// is named by the pull request, never by the base branch, and so is a reusable
    /// workflow it calls (`event_name` `workflow_call`, `head_ref` set).
    #[test]
    fn pull_request_target_runs_are_named_by_their_pull_request_not_the_base_branch() {
        let pull = "spiffe://ddupan.top/ci/owner/repo/pull/7/deploy";
        for event_name in ["pull_request_target", "workflow_call"] {
            let task = pull_request_task(event_name, "refs/heads/main", Some(7.0));
            let identity = Identity::from_task(&task, &td(), IdentityScheme::Ref).unwrap();
            assert_eq!(identity.spiffe_id(), pull, "{event_name}");
            assert_eq!(
                identity.job_ref().map(ToString::to_string).as_deref(),
                Some("pull:7")
            );
        }
        let task = pull_request_task("pull_request", "refs/pull/7/head", Some(7.0));
        assert_eq!(
            Identity::from_task(&task, &td(), IdentityScheme::Ref)
                .unwrap()
                .spiffe_id(),
            pull
        );
        for number in [None, Some(0.0), Some(-3.0), Some(7.5)] {
            let task = pull_request_task("pull_request_target", "refs/heads/main", number);
            let err = Identity::from_task(&task, &td(), IdentityScheme::Ref).unwrap_err();
            assert_eq!(
                err,
                IdentityError::MissingPullRequestNumber {
                    event_name: "pull_request_target".into()
                },
                "{number:?}"
            );
            assert!(err.to_string().contains("pull_request.number"), "{err}");
        }
    }

    /// DESIGN invariant 13: a task without a usable `ref` gets no identity under the ref
    /// scheme (a weaker one would let it pass for a branch), and the reason names the field.
    #[test]
    fn a_task_without_a_usable_ref_gets_no_identity() {
        let no_ref = Identity::from_task(
            &task_in(Some("owner/repo"), &[("event_name", "push")], DEPLOY),
            &td(),
            IdentityScheme::Ref,
        )
        .unwrap_err();
        assert_eq!(no_ref, IdentityError::MissingRef);
        assert!(no_ref.to_string().contains("no ref"), "{no_ref}");
        let mut no_context = task_with(Some("owner/repo"), DEPLOY);
        no_context.context = Default::default();
        assert_eq!(
            Identity::from_task(&no_context, &td(), IdentityScheme::Ref),
            Err(IdentityError::MissingRepository)
        );
        assert_eq!(push(""), Err(IdentityError::MissingRef));
        for bad in [
            "refs/heads/",
            "refs/tags/",
            "refs/pull/",
            "refs/pull/x/head",
            "refs/pull/007/head",
            "refs/pull/0/head",
        ] {
            let err = push(bad).unwrap_err();
            assert_eq!(err, IdentityError::InvalidRef(bad.into()));
            assert!(err.to_string().contains("invalid ref"), "{err}");
        }
    }

    /// DESIGN invariant 13: the ref name is one path segment, so no branch name (with a
    /// `/`, a `-`, a `.`, a space or nothing after `main`) makes an ID under the prefix
    /// `…/branch/main/` a resource server grants main's jobs.
    #[test]
    fn no_other_branch_name_yields_an_id_under_mains_prefix() {
        let main = "spiffe://ddupan.top/ci/owner/repo/branch/main/";
        assert!(push("refs/heads/main").unwrap().starts_with(main));
        for branch in [
            "main/x",
            "main-x",
            "main.x",
            "main_x",
            "main/",
            "main ",
            "main/deploy",
            "Main",
            "main//x",
            "refs/heads/main",
            ".",
            "..",
        ] {
            let id = push(&format!("refs/heads/{branch}")).unwrap();
            assert!(!id.starts_with(main), "{branch:?} gave {id}");
            assert_eq!(
                id.matches('/').count(),
                8,
                "{branch:?}: one segment in {id}"
            );
        }
    }

    /// DESIGN invariant 13: whoever can push a branch can name it after the slug a
    /// protected branch's name is turned into; it still gets a segment of its own.
    #[test]
    fn a_branch_named_after_another_branchs_slug_gets_its_own_segment() {
        let protected = sanitize_ref_name("release/1.0");
        assert!(protected.starts_with("release-1.0-"), "{protected}");
        assert_eq!(protected.len(), "release-1.0-".len() + 32);
        let impostor = sanitize_ref_name(&protected);
        assert_ne!(impostor, protected);
        assert_ne!(
            push(&format!("refs/heads/{protected}")),
            push("refs/heads/release/1.0")
        );
        // Names that only look like an owner's slug are kept as they are.
        assert_eq!(
            sanitize_ref_name("Run-on-Ubuntu-8b7cd4c244fb"),
            "Run-on-Ubuntu-8b7cd4c244fb"
        );
        assert_eq!(sanitize_ref_name("main"), "main");
        assert_eq!(sanitize_ref_name("v1.2.0"), "v1.2.0");
    }

    #[test]
    fn job_refs_read_back_from_their_metadata_form() {
        for (text, kind, name) in [
            ("branch:main", RefKind::Branch, "main"),
            ("branch:feature/x", RefKind::Branch, "feature/x"),
            ("tag:v1", RefKind::Tag, "v1"),
            ("pull:7", RefKind::Pull, "7"),
            ("ref:refs/for/main", RefKind::Other, "refs/for/main"),
        ] {
            let job_ref = JobRef::parse(text).unwrap();
            assert_eq!((job_ref.kind(), job_ref.name()), (kind, name));
            assert_eq!(job_ref.to_string(), text);
        }
        for bad in [
            "",
            "main",
            "branch:",
            "pull:x",
            "pull:07",
            "heads:main",
            ":main",
        ] {
            assert_eq!(
                JobRef::parse(bad),
                Err(IdentityError::InvalidRef(bad.into())),
                "{bad}"
            );
        }
    }

    /// DESIGN invariant 13: recovered metadata must carry exactly the ID its repository,
    /// ref and job key derive; an ID of the other scheme is refused.
    #[test]
    fn recovered_metadata_of_the_ref_scheme_must_carry_exactly_the_derived_id() {
        let id = "spiffe://ddupan.top/ci/owner/repo/branch/main/publish";
        let identity =
            Identity::from_metadata("owner/repo", "publish", Some("branch:main"), id, &td())
                .unwrap();
        assert_eq!(identity.scheme(), IdentityScheme::Ref);
        for (job_ref, id) in [
            (
                Some("branch:main"),
                "spiffe://ddupan.top/ci/owner/repo/publish",
            ),
            (None, id),
            (Some("pull:7"), id),
            (
                Some("branch:main"),
                "spiffe://ddupan.top/ci/owner/repo/branch/other/publish",
            ),
            (Some("main"), id),
        ] {
            assert!(
                Identity::from_metadata("owner/repo", "publish", job_ref, id, &td()).is_err(),
                "{job_ref:?} {id}"
            );
        }
    }

    #[test]
    fn identity_schemes_are_spelled_ref_and_job() {
        assert_eq!(IdentityScheme::default(), IdentityScheme::Ref);
        for scheme in [IdentityScheme::Ref, IdentityScheme::Job] {
            assert_eq!(scheme.as_str().parse::<IdentityScheme>(), Ok(scheme));
        }
        assert!("Ref".parse::<IdentityScheme>().is_err());
    }

    #[test]
    fn ref_scheme_spiffe_ids_are_checked_by_shape() {
        let td = TrustDomain::new("example.org").unwrap();
        for good in [
            "spiffe://example.org/ci/o/r/branch/main/build",
            "spiffe://example.org/ci/o/r/tag/v1.0/build",
            "spiffe://example.org/ci/o/r/pull/12/build",
            "spiffe://example.org/ci/o/r/ref/refs-for-main-0123456789abcdef0123456789abcdef/build",
        ] {
            assert_eq!(check_job_spiffe_id(good, &td), Ok(()), "{good}");
        }
        for bad in [
            "spiffe://example.org/ci/o/r/heads/main/build",
            "spiffe://example.org/ci/o/r/branch/../build",
            "spiffe://example.org/ci/o/r/branch//build",
            "spiffe://example.org/ci/o/r/branch/a b/build",
            "spiffe://example.org/ci/o/r/branch/main/1build",
            "spiffe://example.org/ci/o/r/branch/main/x/build",
            "spiffe://example.org/ci/o/r/branch/build",
        ] {
            assert!(check_job_spiffe_id(bad, &td).is_err(), "{bad}");
        }
    }

    /// Branch names as anybody who can push may choose them: near `main`, slashes,
    /// punctuation, non-ASCII, and names shaped like slugs with digests.
    fn branch_name() -> impl Strategy<Value = String> {
        prop_oneof![
            "(main)?[A-Za-z0-9./_@+#ü -]{0,30}",
            "[a-z0-9.-]{1,20}-[0-9a-f]{32}",
            ".{1,60}",
        ]
    }

    proptest! {
        /// DESIGN invariant 13: every ref name becomes one usable segment; only `main`
        /// itself is under main's prefix; a name and the segment of another name (its slug)
        /// never share a segment unless the name was kept as it is.
        #[test]
        fn every_ref_name_is_one_segment_and_only_main_is_under_mains_prefix(name in branch_name()) {
            let segment = sanitize_ref_name(&name);
            prop_assert!(is_safe_segment(&segment) && segment != "." && segment != "..", "{segment:?}");
            let id = push(&format!("refs/heads/{name}"));
            if let Ok(id) = id {
                prop_assert_eq!(check_job_spiffe_id(&id, &td()), Ok(()));
                prop_assert_eq!(
                    id.starts_with("spiffe://ddupan.top/ci/owner/repo/branch/main/"),
                    name == "main"
                );
            } else {
                prop_assert!(name.is_empty(), "{id:?}");
            }
            let again = sanitize_ref_name(&segment);
            prop_assert_eq!(again == segment, segment == name, "{:?} {:?}", name, segment);
        }
    }
}
