//! The assignment: the durable handoff between the scheduler and the workers (DESIGN
//! invariant 5).
//!
//! An assignment is the complete Gitea `Task` plus three fields derived from it: the
//! assignment ID, the backend and the identity. The derived fields travel in the envelope
//! only so that humans and routing can read them; every consumer decodes the task and
//! derives them again, and an envelope whose copies disagree is rejected as tampered.
//!
//! Two envelope versions exist:
//! - **v1**, byte-compatible with the Go seed (`json.Marshal` of its `envelope` struct): the
//!   task protobuf in plain base64. Still read, so a Rust controller can drain a Go queue.
//! - **v2**: the task protobuf sealed with AES-256-GCM under a key from a file, so job
//!   secrets do not sit readable in the stream. The redundant fields, the key ID and the
//!   fetch time are bound as additional data, so ciphertext cannot be moved between
//!   envelopes and an envelope cannot be made younger than it is. Since the `id_mac` field
//!   exists, the same fields also carry a MAC under a key derived from the capability key
//!   ([`crate::capability::EnvelopeIdKey`]), so a controller that lacks the task key can
//!   still tell whether its own scheduler wrote the assignment ID ([`authenticated_id`]).
//!
//! [`decode_with`] applies the queue's trust rules on top (DESIGN invariants 20, 21): where
//! a task key is configured a plaintext v1 envelope is refused (anyone able to publish
//! could write one for any repository), an envelope fetched longer ago than Gitea lets
//! a task run is refused (a replay of an old job), and so is a v2 envelope without a fetch
//! time (written by an older release: its age cannot be told) unless the operator admits
//! those for an upgrade.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_lc_rs::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use aws_lc_rs::digest;
use aws_lc_rs::rand::{SecureRandom, SystemRandom};
use base64::Engine;
use base64::engine::general_purpose::{
    STANDARD, STANDARD_NO_PAD_INDIFFERENT, URL_SAFE_NO_PAD, URL_SAFE_NO_PAD_INDIFFERENT,
};
use buffa::Message;
use gdr_proto::runner::v1::Task;
use serde::{Deserialize, Serialize};

use super::backend::{Backend, BackendError, BackendLabels, select_backend};
use super::capability::EnvelopeIdKey;
use super::identity::{Identity, IdentityError, IdentityScheme, TrustDomain};
use super::workflow::{WorkflowError, parse_single_job};

pub use super::assignment_id::{AssignmentId, AssignmentIdError};

// === Assignment ===

/// The operator policy that turns a task into an assignment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DerivationPolicy {
    /// Trust domain of the SPIFFE IDs.
    pub trust_domain: TrustDomain,
    /// How SPIFFE IDs are formed. Consumers derive with it too, so an envelope whose
    /// identity was derived under the other scheme is refused as tampered.
    pub scheme: IdentityScheme,
    /// Labels that select the backend.
    pub labels: BackendLabels,
}

/// Why a task cannot become an assignment. Permanent: the same task always fails the same way.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssignmentError {
    /// The task ID is not positive.
    #[error("invalid task ID: {0}")]
    TaskId(#[from] AssignmentIdError),
    /// The workflow payload is unreadable.
    #[error("task workflow: {0}")]
    Workflow(#[from] WorkflowError),
    /// `runs-on` does not select exactly one backend.
    #[error("task backend: {0}")]
    Backend(#[from] BackendError),
    /// No identity can be derived.
    #[error("task identity: {0}")]
    Identity(#[from] IdentityError),
}

/// A task with its derived ID, backend and identity. Only [`Assignment::from_task`] and
/// [`decode`] build one, so the derived fields always agree with the task.
#[derive(Clone, PartialEq)]
pub struct Assignment {
    id: AssignmentId,
    backend: Backend,
    task: Task,
    identity: Identity,
    runs_on: Vec<String>,
    /// When the task was fetched from Gitea (whole seconds), if known: set by the scheduler,
    /// carried authenticated in v2 envelopes; v1 envelopes have none.
    fetched_at: Option<u64>,
}

impl Assignment {
    /// Derives every trusted field from the task Gitea handed out.
    pub fn from_task(task: Task, policy: &DerivationPolicy) -> Result<Self, AssignmentError> {
        let id = AssignmentId::from_task_id(task.id)?;
        let job = parse_single_job(task.workflow_payload.as_deref().unwrap_or_default())?;
        let identity = Identity::from_task_job(&task, &job, &policy.trust_domain, policy.scheme)?;
        let backend = select_backend(&job.runs_on, &policy.labels)?;
        Ok(Self {
            id,
            backend,
            task,
            identity,
            runs_on: job.runs_on,
            fetched_at: None,
        })
    }

    /// The same assignment, recorded as fetched from Gitea at `at` (kept to the second).
    #[must_use]
    pub fn with_fetch_time(mut self, at: SystemTime) -> Self {
        self.fetched_at = Some(at.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs());
        self
    }

    /// When the task was fetched from Gitea, if the envelope said (v2).
    pub fn fetch_time(&self) -> Option<SystemTime> {
        self.fetched_at
            .map(|secs| UNIX_EPOCH + Duration::from_secs(secs))
    }

    /// The assignment ID.
    pub fn id(&self) -> &AssignmentId {
        &self.id
    }

    /// The backend selected by `runs-on`.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The Gitea task, complete (including its secrets).
    pub fn task(&self) -> &Task {
        &self.task
    }

    /// The job's identity.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The job's `runs-on` labels, as its workflow states them.
    pub fn runs_on(&self) -> &[String] {
        &self.runs_on
    }
}

impl fmt::Debug for Assignment {
    // The task holds job secrets and the workflow; only the routing facts are printed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Assignment")
            .field("id", &self.id.as_str())
            .field("backend", &self.backend)
            .field("spiffe_id", &self.identity.spiffe_id())
            .finish_non_exhaustive()
    }
}

/// What backend metadata tells about a running executor: enough to authorise it, not the task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveredAssignment {
    id: AssignmentId,
    task_id: i64,
    backend: Backend,
    identity: Identity,
}

impl RecoveredAssignment {
    /// The routing facts of an assignment. Only the metadata codec and
    /// [`RecoveredAssignment::from_assignment`] call this, after validating each part.
    pub(crate) fn new(id: AssignmentId, backend: Backend, identity: Identity) -> Self {
        RecoveredAssignment {
            task_id: id.task_id(),
            id,
            backend,
            identity,
        }
    }

    /// The routing facts of a full assignment, as backend metadata records them.
    pub fn from_assignment(assignment: &Assignment) -> Self {
        RecoveredAssignment {
            id: assignment.id.clone(),
            task_id: assignment.id.task_id(),
            backend: assignment.backend,
            identity: assignment.identity.clone(),
        }
    }

    /// The assignment ID.
    pub fn id(&self) -> &AssignmentId {
        &self.id
    }

    /// The Gitea task ID.
    pub fn task_id(&self) -> i64 {
        self.task_id
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The job's identity.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }
}

// === Task keys ===

const TASK_KEY_BYTES: usize = 32;
const KEY_ID_CONTEXT: &[u8] = b"gitea-dynamic-runner task key\0";
const KEY_FORMAT_HINT: &str = "expected 64 hex characters or base64 of exactly 32 bytes (generate one with `head -c 32 /dev/urandom | base64`)";

/// An AES-256-GCM key for task bytes at rest (envelope v2).
///
/// Its ID is derived from the key itself, so rotation needs no separate ID configuration
/// and an envelope names the key it needs without revealing anything useful about it.
#[derive(Clone)]
pub struct TaskKey {
    key: [u8; TASK_KEY_BYTES],
    id: String,
}

/// A task key file that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TaskKeyError {
    /// Neither hex nor base64.
    #[error("task key is neither hex nor base64: {KEY_FORMAT_HINT}")]
    Format,
    /// Decodes, but not to 32 bytes.
    #[error("task key decodes to {len} bytes: {KEY_FORMAT_HINT}")]
    Length {
        /// Decoded length.
        len: usize,
    },
    /// The system's random source failed while generating a key.
    #[error("no randomness for a new task key")]
    Random,
}

impl TaskKey {
    /// A key from its raw 32 bytes.
    pub fn from_bytes(key: [u8; TASK_KEY_BYTES]) -> Self {
        let mut context = digest::Context::new(&digest::SHA256);
        context.update(KEY_ID_CONTEXT);
        context.update(&key);
        let id = context
            .finish()
            .as_ref()
            .iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect();
        Self { key, id }
    }

    /// A key from the text of a key file, surrounding whitespace ignored: 64 hex digits, or
    /// base64 (standard or URL-safe alphabet, padded or not) of exactly 32 bytes.
    pub fn from_file_contents(contents: &[u8]) -> Result<Self, TaskKeyError> {
        let text = contents.trim_ascii();
        let bytes = match decode_hex(text) {
            Some(bytes) => bytes,
            None => STANDARD_NO_PAD_INDIFFERENT
                .decode(text)
                .or_else(|_| URL_SAFE_NO_PAD_INDIFFERENT.decode(text))
                .map_err(|_| TaskKeyError::Format)?,
        };
        let key: [u8; TASK_KEY_BYTES] = bytes
            .as_slice()
            .try_into()
            .map_err(|_| TaskKeyError::Length { len: bytes.len() })?;
        Ok(Self::from_bytes(key))
    }

    /// A new random key and the text of its key file (64 hex digits and a newline).
    pub fn generate() -> Result<(Self, String), TaskKeyError> {
        let mut key = [0u8; TASK_KEY_BYTES];
        SystemRandom::new()
            .fill(&mut key)
            .map_err(|_| TaskKeyError::Random)?;
        let mut text: String = key.iter().map(|b| format!("{b:02x}")).collect();
        text.push('\n');
        Ok((Self::from_bytes(key), text))
    }

    /// First 16 hex digits of SHA-256(`"gitea-dynamic-runner task key\0"` + key).
    pub fn key_id(&self) -> &str {
        &self.id
    }

    fn aead_key(&self) -> Option<LessSafeKey> {
        // Only fails for a wrong key length, which the array type rules out.
        UnboundKey::new(&AES_256_GCM, &self.key)
            .ok()
            .map(LessSafeKey::new)
    }
}

impl fmt::Debug for TaskKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TaskKey")
            .field("key_id", &self.id)
            .finish_non_exhaustive()
    }
}

/// Only 64 hex digits count as hex: shorter hex strings are valid base64 too, and reading
/// them as base64 keeps the two forms unambiguous.
fn decode_hex(text: &[u8]) -> Option<Vec<u8>> {
    if text.len() != 2 * TASK_KEY_BYTES {
        return None;
    }
    let nibble = |c: u8| (c as char).to_digit(16);
    text.chunks_exact(2)
        .map(|pair| Some((nibble(pair[0])? << 4 | nibble(pair[1])?) as u8))
        .collect()
}

/// The task keys in use: new envelopes are sealed with `current`; envelopes sealed with
/// any of them are opened. Rotate by deploying the new key as `previous` everywhere, then
/// promoting it to `current`, and drop the old key once no envelope sealed with it remains
/// in the stream (a consumer that lacks a key rejects the message for good).
#[derive(Clone, Debug)]
pub struct TaskKeyring {
    /// Seals new envelopes.
    pub current: TaskKey,
    /// Still open older envelopes.
    pub previous: Vec<TaskKey>,
}

impl TaskKeyring {
    /// A keyring sealing with `current` and also opening with `previous`.
    pub fn new(current: TaskKey, previous: Vec<TaskKey>) -> Self {
        Self { current, previous }
    }

    fn find(&self, key_id: &str) -> Option<&TaskKey> {
        std::iter::once(&self.current)
            .chain(&self.previous)
            .find(|key| key.key_id() == key_id)
    }
}

// === Envelope ===

/// Go's `taskidentity.Identity` as `json.Marshal` writes it (exported field names, in order).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireIdentity {
    #[serde(rename = "Repository")]
    repository: String,
    #[serde(rename = "Task")]
    job_key: String,
    #[serde(rename = "SPIFFEID")]
    spiffe_id: String,
}

impl From<&Identity> for WireIdentity {
    fn from(identity: &Identity) -> Self {
        Self {
            repository: identity.repository().to_owned(),
            job_key: identity.job_key().to_owned(),
            spiffe_id: identity.spiffe_id().to_owned(),
        }
    }
}

/// Field order is the Go struct's, so the output is byte-identical to the seed's for every
/// valid assignment (Go additionally escapes `<`, `>`, `&`, which valid IDs never contain).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct EnvelopeV1 {
    version: u64,
    id: String,
    backend: String,
    task: String,
    identity: WireIdentity,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct EnvelopeV2 {
    version: u64,
    id: String,
    backend: String,
    key_id: String,
    nonce: String,
    task: String,
    identity: WireIdentity,
    /// Unix seconds of the fetch from Gitea. Optional only so that envelopes written before
    /// it existed still open; when present it is part of the additional data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fetched_at: Option<u64>,
    /// base64url (no padding) HMAC-SHA256 of the additional data under the controller's
    /// [`EnvelopeIdKey`]: authenticates the ID where the task key is missing. Not part of
    /// the additional data, so envelopes written before it existed open unchanged, and
    /// removing it only makes the ID unauthenticated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id_mac: Option<String>,
}

#[derive(Deserialize)]
struct VersionProbe {
    version: u64,
}

#[derive(Deserialize)]
struct IdProbe {
    id: String,
}

/// The assignment ID an envelope of any version names, read without decrypting or
/// validating anything else. For routing facts only (heartbeats, logs about a message that
/// cannot be opened); never trust it for authorisation: [`decode`] re-derives everything,
/// and [`authenticated_id`] checks it without the task key.
pub fn envelope_id(bytes: &[u8]) -> Option<AssignmentId> {
    let probe: IdProbe = serde_json::from_slice(bytes).ok()?;
    AssignmentId::parse(&probe.id).ok()
}

/// The routing facts of a v2 envelope whose `id_mac` verified: written by a scheduler
/// holding the same capability key, whatever task key sealed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthenticatedId {
    id: AssignmentId,
    fetched_at: Option<u64>,
}

impl AuthenticatedId {
    /// The assignment ID.
    pub fn id(&self) -> &AssignmentId {
        &self.id
    }

    /// When the task was fetched from Gitea, as the envelope says (authenticated too).
    pub fn fetch_time(&self) -> Option<SystemTime> {
        self.fetched_at
            .map(|secs| UNIX_EPOCH + Duration::from_secs(secs))
    }

    /// The age rules of [`decode_with`] applied to the authenticated fetch time: an
    /// envelope Gitea has ended the task of since is refused as for a worker.
    pub fn check_age(&self, rules: &EnvelopeRules) -> Result<(), EnvelopeError> {
        check_age(self.fetched_at, rules)
    }
}

/// The assignment ID of a v2 envelope if its `id_mac` verifies under `key`, read without
/// the task key. `None` for v1, for an envelope without `id_mac` (written by an older
/// release) and for a forged or altered one: nobody may then act on that ID in Gitea or in
/// the finished-assignments record (DESIGN invariant 21).
pub fn authenticated_id(bytes: &[u8], key: &EnvelopeIdKey) -> Option<AuthenticatedId> {
    let probe: VersionProbe = serde_json::from_slice(bytes).ok()?;
    if probe.version != 2 {
        return None;
    }
    let envelope: EnvelopeV2 = serde_json::from_slice(bytes).ok()?;
    let mac = URL_SAFE_NO_PAD_INDIFFERENT
        .decode(envelope.id_mac.as_deref()?)
        .ok()?;
    let aad = aad_v2(
        &envelope.id,
        &envelope.backend,
        &envelope.identity,
        &envelope.key_id,
        envelope.fetched_at,
    );
    if !key.verify(&aad, &mac) {
        return None;
    }
    Some(AuthenticatedId {
        id: AssignmentId::parse(&envelope.id).ok()?,
        fetched_at: envelope.fetched_at,
    })
}

/// Why an envelope cannot be encoded. Not expected in practice.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// The task exceeds the 2 GiB protobuf limit.
    #[error("task is too large to encode")]
    TaskTooLarge,
    /// The system random source failed.
    #[error("no random nonce available")]
    Random,
    /// The AEAD refused to seal.
    #[error("task encryption failed")]
    Seal,
    /// JSON serialisation failed.
    #[error("envelope serialisation failed")]
    Json,
}

/// Why an envelope was rejected.
///
/// Every variant is permanent for the message at hand: decoding it again gives the same
/// result, so the worker terminates (TERM) the message instead of redelivering it, and
/// [`EnvelopeError::is_poison`] says so. `UnknownKey` and `NoKeyring` usually mean the
/// consumer's key configuration lags the producer's (see [`TaskKeyring`] on rotation order).
/// No message contains payload bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    /// Not JSON, wrong shape, bad base64 or an undecodable task protobuf.
    #[error("malformed assignment envelope: {0}")]
    Malformed(String),
    /// A version this build does not read.
    #[error("unsupported assignment envelope version {0}")]
    UnsupportedVersion(u64),
    /// Sealed with a key this consumer does not have.
    #[error("assignment envelope is sealed with unknown task key {0}")]
    UnknownKey(String),
    /// A v2 envelope, but no task keys are configured.
    #[error("assignment envelope is encrypted but no task key is configured")]
    NoKeyring,
    /// Authentication failed: wrong key, altered ciphertext or altered bound fields.
    #[error("assignment envelope does not decrypt")]
    Decrypt,
    /// A redundant field disagrees with the one derived from the task.
    #[error("assignment envelope field {field} does not match its task")]
    Tampered {
        /// The envelope field, as spelled on the wire.
        field: &'static str,
    },
    /// The task inside does not make a valid assignment.
    #[error("assignment envelope task: {0}")]
    Invalid(#[from] AssignmentError),
    /// A plaintext v1 envelope where a task key is configured: it proves nothing about who
    /// wrote it (see [`EnvelopeRules::accept_plaintext`]).
    #[error(
        "plaintext (v1) assignment envelope refused: a task key is configured, so only sealed envelopes are trusted (accept_plaintext_envelopes allows v1 during a migration)"
    )]
    Plaintext,
    /// Fetched from Gitea longer ago than [`EnvelopeRules::max_age`]: Gitea has ended the
    /// task since, so this is a stale copy or a replay.
    #[error("assignment envelope fetched {age}s ago, longer than the {max_age}s a task may live")]
    Expired {
        /// Seconds since the fetch.
        age: u64,
        /// The bound, in seconds.
        max_age: u64,
    },
    /// Fetched further in the future than clocks can disagree.
    #[error("assignment envelope claims a fetch {ahead}s in the future")]
    FromTheFuture {
        /// Seconds ahead of this clock.
        ahead: u64,
    },
    /// A v2 envelope without a fetch time (written by a release before the fetch time
    /// existed): its age cannot be checked, so a copy could be replayed once its finished
    /// record expired (see [`EnvelopeRules::accept_undated`]).
    #[error(
        "assignment envelope has no fetch time (written by an older release), so its age cannot be checked (accept_undated_envelopes admits such envelopes during an upgrade)"
    )]
    Undated,
}

impl EnvelopeError {
    /// Whether redelivering the message can never succeed. Always true for this error
    /// type; kept as a method so the worker states its decision where it acks.
    pub fn is_poison(&self) -> bool {
        true
    }
}

fn encode_task(task: &Task) -> Result<Vec<u8>, EncodeError> {
    task.try_encode_to_vec()
        .map_err(|_| EncodeError::TaskTooLarge)
}

/// Encodes `assignment` as a version 1 envelope, as the Go seed does. Job secrets are
/// readable in it: use [`encode_v2`] wherever a task key is configured.
pub fn encode_v1(assignment: &Assignment) -> Result<Vec<u8>, EncodeError> {
    let envelope = EnvelopeV1 {
        version: 1,
        id: assignment.id.as_str().to_owned(),
        backend: assignment.backend.as_str().to_owned(),
        task: STANDARD.encode(encode_task(&assignment.task)?),
        identity: (&assignment.identity).into(),
    };
    serde_json::to_vec(&envelope).map_err(|_| EncodeError::Json)
}

/// The additional data of a v2 envelope: every redundant field and the key ID, each
/// length-prefixed so that no two different field tuples give the same bytes.
/// The fetch time, when present, is a seventh field, so an envelope without it (written
/// before it existed) keeps its original additional data, and adding or removing it breaks
/// the tag.
fn aad_v2(
    id: &str,
    backend: &str,
    identity: &WireIdentity,
    key_id: &str,
    fetched_at: Option<u64>,
) -> Vec<u8> {
    let mut aad = b"gitea-dynamic-runner assignment v2\0".to_vec();
    let fetched_at = fetched_at.map(|t| t.to_string());
    for field in [
        id,
        backend,
        &identity.repository,
        &identity.job_key,
        &identity.spiffe_id,
        key_id,
    ]
    .into_iter()
    .chain(fetched_at.as_deref())
    {
        aad.extend_from_slice(&(field.len() as u64).to_be_bytes());
        aad.extend_from_slice(field.as_bytes());
    }
    aad
}

/// Encodes `assignment` as a version 2 envelope, the task sealed with the current key,
/// without `id_mac` (as releases before it wrote them): where the task key is missing,
/// its ID cannot be authenticated. The scheduler uses [`encode_v2_with_id_mac`].
pub fn encode_v2(assignment: &Assignment, keyring: &TaskKeyring) -> Result<Vec<u8>, EncodeError> {
    seal_v2(assignment, keyring, None)
}

/// [`encode_v2`] with `id_mac` under `id_key`, so a controller holding the same capability
/// key can authenticate the assignment ID without the task key ([`authenticated_id`]).
pub fn encode_v2_with_id_mac(
    assignment: &Assignment,
    keyring: &TaskKeyring,
    id_key: &EnvelopeIdKey,
) -> Result<Vec<u8>, EncodeError> {
    seal_v2(assignment, keyring, Some(id_key))
}

fn seal_v2(
    assignment: &Assignment,
    keyring: &TaskKeyring,
    id_key: Option<&EnvelopeIdKey>,
) -> Result<Vec<u8>, EncodeError> {
    let key = &keyring.current;
    let mut nonce = [0u8; NONCE_LEN];
    // A fresh random 96-bit nonce per envelope. NIST SP 800-38D allows 2^32 random-nonce
    // messages per key; a controller seals one per job, many orders of magnitude fewer.
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| EncodeError::Random)?;
    let identity = WireIdentity::from(&assignment.identity);
    let id = assignment.id.as_str();
    let backend = assignment.backend.as_str();
    let aad = aad_v2(id, backend, &identity, key.key_id(), assignment.fetched_at);
    let id_mac = id_key.map(|k| URL_SAFE_NO_PAD.encode(k.mac(&aad)));
    let mut sealed = encode_task(&assignment.task)?;
    key.aead_key()
        .ok_or(EncodeError::Seal)?
        .seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(aad),
            &mut sealed,
        )
        .map_err(|_| EncodeError::Seal)?;
    let envelope = EnvelopeV2 {
        version: 2,
        id: id.to_owned(),
        backend: backend.to_owned(),
        key_id: key.key_id().to_owned(),
        nonce: STANDARD.encode(nonce),
        task: STANDARD.encode(sealed),
        identity,
        fetched_at: assignment.fetched_at,
        id_mac,
    };
    serde_json::to_vec(&envelope).map_err(|_| EncodeError::Json)
}

/// Describes a JSON error by category and position only: serde_json's own message can quote
/// input, and the input may hold a plaintext task.
fn json_error(err: &serde_json::Error) -> EnvelopeError {
    let kind = match err.classify() {
        serde_json::error::Category::Io => "read error",
        serde_json::error::Category::Syntax => "invalid JSON",
        serde_json::error::Category::Data => "unexpected fields or types",
        serde_json::error::Category::Eof => "truncated JSON",
    };
    EnvelopeError::Malformed(format!(
        "{kind} at line {} column {}",
        err.line(),
        err.column()
    ))
}

fn decode_base64(field: &str, text: &str) -> Result<Vec<u8>, EnvelopeError> {
    STANDARD
        .decode(text)
        .map_err(|_| EnvelopeError::Malformed(format!("{field} is not valid base64")))
}

fn is_key_id(text: &str) -> bool {
    text.len() == 16
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// How far ahead of this clock a fetch time may be (clocks of two replicas disagree).
const CLOCK_SKEW: u64 = 300;

/// The queue's trust rules, applied by [`decode_with`] after an envelope decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvelopeRules {
    /// Accept plaintext v1 envelopes although a keyring is given (a migration from the Go
    /// version, whose queue holds v1). Without a keyring v1 is always accepted.
    pub accept_plaintext: bool,
    /// Refuse an envelope fetched longer ago than this (Gitea's endless-task timeout: a
    /// task is ended by Gitea after it, so a younger envelope cannot be a live job).
    pub max_age: Duration,
    /// Accept v2 envelopes without a fetch time (written by a release before it existed),
    /// which have no age limit: only while upgrading from such a release. v1 envelopes have
    /// no fetch time either; [`EnvelopeRules::accept_plaintext`] decides about them.
    pub accept_undated: bool,
    /// The current time.
    pub now: SystemTime,
}

impl EnvelopeRules {
    /// Rules that refuse nothing [`decode`] accepts.
    pub fn permissive() -> Self {
        EnvelopeRules {
            accept_plaintext: true,
            max_age: Duration::MAX,
            accept_undated: true,
            now: SystemTime::now(),
        }
    }
}

/// Decodes a v1 or v2 envelope, then derives the assignment from the task inside and
/// rejects the envelope if its `id`, `backend` or `identity` differ from the derived ones.
/// `keyring` is needed only for v2. Never panics. Applies no trust rules: a consumer of the
/// queue uses [`decode_with`].
pub fn decode(
    bytes: &[u8],
    policy: &DerivationPolicy,
    keyring: Option<&TaskKeyring>,
) -> Result<Assignment, EnvelopeError> {
    decode_with(bytes, policy, keyring, &EnvelopeRules::permissive())
}

/// [`decode`], then `rules`: a v1 envelope is refused when `keyring` is given unless
/// plaintext is accepted, and a v2 envelope fetched more than `max_age` ago (or more than
/// five minutes in the future), or without a fetch time unless undated ones are accepted,
/// is refused.
pub fn decode_with(
    bytes: &[u8],
    policy: &DerivationPolicy,
    keyring: Option<&TaskKeyring>,
    rules: &EnvelopeRules,
) -> Result<Assignment, EnvelopeError> {
    open(&parse(bytes)?, policy, keyring, rules)
}

/// A delivery's payload, parsed once: the ID it names ([`Envelope::id`], for routing and
/// logs) and its opening ([`Envelope::open`]) read the same parse.
pub struct Envelope {
    parsed: Result<Parsed, EnvelopeError>,
    id: Option<AssignmentId>,
}

impl Envelope {
    /// Parses `bytes` as an envelope of a version this build reads.
    pub fn parse(bytes: &[u8]) -> Self {
        let parsed = parse(bytes);
        let id = match &parsed {
            Ok(Parsed::V1(envelope)) => AssignmentId::parse(&envelope.id).ok(),
            Ok(Parsed::V2(envelope)) => AssignmentId::parse(&envelope.id).ok(),
            // Not an envelope this build opens: its ID may still be readable, for the log.
            Err(_) => envelope_id(bytes),
        };
        Envelope { parsed, id }
    }

    /// The assignment ID it names, as [`envelope_id`] reads it: unauthenticated, never for
    /// authorisation.
    pub fn id(&self) -> Option<&AssignmentId> {
        self.id.as_ref()
    }

    /// The assignment, as [`decode_with`] opens these bytes.
    pub fn open(
        &self,
        policy: &DerivationPolicy,
        keyring: Option<&TaskKeyring>,
        rules: &EnvelopeRules,
    ) -> Result<Assignment, EnvelopeError> {
        match &self.parsed {
            Ok(parsed) => open(parsed, policy, keyring, rules),
            Err(e) => Err(e.clone()),
        }
    }
}

/// An envelope's JSON, of a version this build reads.
enum Parsed {
    V1(EnvelopeV1),
    V2(EnvelopeV2),
}

fn parse(bytes: &[u8]) -> Result<Parsed, EnvelopeError> {
    let probe: VersionProbe = serde_json::from_slice(bytes).map_err(|e| json_error(&e))?;
    let json = |e: serde_json::Error| json_error(&e);
    match probe.version {
        1 => Ok(Parsed::V1(serde_json::from_slice(bytes).map_err(json)?)),
        2 => Ok(Parsed::V2(serde_json::from_slice(bytes).map_err(json)?)),
        other => Err(EnvelopeError::UnsupportedVersion(other)),
    }
}

/// Decrypts (v2), applies `rules`, derives the assignment from the task inside and rejects
/// the envelope if its `id`, `backend` or `identity` differ from the derived ones.
fn open(
    parsed: &Parsed,
    policy: &DerivationPolicy,
    keyring: Option<&TaskKeyring>,
    rules: &EnvelopeRules,
) -> Result<Assignment, EnvelopeError> {
    let (id, backend, identity, task_bytes, fetched_at) = match parsed {
        Parsed::V1(envelope) => {
            if keyring.is_some() && !rules.accept_plaintext {
                return Err(EnvelopeError::Plaintext);
            }
            let task = decode_base64("task", &envelope.task)?;
            (
                &envelope.id,
                &envelope.backend,
                &envelope.identity,
                task,
                None,
            )
        }
        Parsed::V2(envelope) => {
            let keyring = keyring.ok_or(EnvelopeError::NoKeyring)?;
            if !is_key_id(&envelope.key_id) {
                return Err(EnvelopeError::Malformed(
                    "key_id is not a task key ID".into(),
                ));
            }
            let key = keyring
                .find(&envelope.key_id)
                .ok_or_else(|| EnvelopeError::UnknownKey(envelope.key_id.clone()))?;
            let nonce: [u8; NONCE_LEN] = decode_base64("nonce", &envelope.nonce)?
                .try_into()
                .map_err(|_| EnvelopeError::Malformed(format!("nonce is not {NONCE_LEN} bytes")))?;
            let mut sealed = decode_base64("task", &envelope.task)?;
            let aad = aad_v2(
                &envelope.id,
                &envelope.backend,
                &envelope.identity,
                &envelope.key_id,
                envelope.fetched_at,
            );
            let plain_len = key
                .aead_key()
                .ok_or(EnvelopeError::Decrypt)?
                .open_in_place(
                    Nonce::assume_unique_for_key(nonce),
                    Aad::from(aad),
                    &mut sealed,
                )
                .map_err(|_| EnvelopeError::Decrypt)?
                .len();
            sealed.truncate(plain_len);
            check_age(envelope.fetched_at, rules)?;
            (
                &envelope.id,
                &envelope.backend,
                &envelope.identity,
                sealed,
                envelope.fetched_at,
            )
        }
    };
    let task = Task::decode_from_slice(&task_bytes)
        .map_err(|_| EnvelopeError::Malformed("task is not a valid Task protobuf".into()))?;
    let mut assignment = Assignment::from_task(task, policy)?;
    assignment.fetched_at = fetched_at;
    let tampered = |field| Err(EnvelopeError::Tampered { field });
    if id != assignment.id.as_str() {
        return tampered("id");
    }
    if backend != assignment.backend.as_str() {
        return tampered("backend");
    }
    if identity.repository != assignment.identity.repository() {
        return tampered("identity.Repository");
    }
    if identity.job_key != assignment.identity.job_key() {
        return tampered("identity.Task");
    }
    if identity.spiffe_id != assignment.identity.spiffe_id() {
        return tampered("identity.SPIFFEID");
    }
    Ok(assignment)
}

/// The fetch time (authenticated already) against the rules' bounds.
fn check_age(fetched_at: Option<u64>, rules: &EnvelopeRules) -> Result<(), EnvelopeError> {
    let Some(fetched_at) = fetched_at else {
        return if rules.accept_undated {
            Ok(())
        } else {
            Err(EnvelopeError::Undated)
        };
    };
    let now = rules
        .now
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    if fetched_at > now.saturating_add(CLOCK_SKEW) {
        return Err(EnvelopeError::FromTheFuture {
            ahead: fetched_at - now,
        });
    }
    let age = now.saturating_sub(fetched_at);
    if u128::from(age) > rules.max_age.as_millis() / 1000 {
        return Err(EnvelopeError::Expired {
            age,
            max_age: rules.max_age.as_secs(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
