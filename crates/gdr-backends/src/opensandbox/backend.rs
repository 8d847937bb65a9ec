//! The VM executor backend: one OpenSandbox sandbox (a Kata microVM from a pool) per
//! assignment, created only through the Lifecycle API (DESIGN invariants 8–12).
//!
//! - **State lives in sandbox metadata**, written by the one codec: the routing labels
//!   (`runner=true`, `assignment-id`, `task-id`, `backend`), the identity annotations as
//!   base64url chunks (`annotations-000`, …; metadata values are label-limited), and the
//!   `claimed`/`terminal` markers added by merge-patch. Everything read back is re-validated;
//!   a sandbox whose metadata does not decode is skipped by `list` and refused by `find`.
//! - **Find** lists by the assignment label; **recovery** lists by the runner label.
//! - **Phases**: a sandbox whose executor exited stays `Running` in OpenSandbox, so the end
//!   of a job is known from the terminal marker (the facade) or from the executor's silence,
//!   never from the sandbox state. `Failed`, `Terminated` and `Stopping` read as
//!   [`Phase::Finished`] with the server's reason; a sandbox that is gone is `None`.
//! - **Expiry**: a sandbox is created with `timeout`; [`ExecutorBackend::list`] (which the
//!   lifecycle reconciler calls every pass) extends every non-terminal sandbox whose expiry
//!   is less than `renew_before` away, so a job may run longer than the sandbox timeout while
//!   a crashed controller's sandboxes still expire.
//! - **Identity**: the target is the sandbox ID; `sandbox-identity`, in the sandbox cluster,
//!   binds the sandbox's Pods to the job's SPIFFE ID. The controller cannot see that entry:
//!   the identity counts as bound once the sandbox runs, and the executor itself waits for
//!   its SVID.
//! - **Errors**: 429 → [`ExecutorError::Full`] with the server's `Retry-After`; 400/422 →
//!   [`ExecutorError::Permanent`] with the server's message; everything else, including
//!   504 (the server gave up and deleted the sandbox) and the configuration errors (401/403,
//!   pool not found: the operator fixes them and queued jobs proceed), →
//!   [`ExecutorError::Unavailable`]; [`ClientError::is_configuration`] tells them apart.
//!
//! The executor environment, the capability included, is part of the sandbox spec
//! (`BatchSandbox.spec.taskTemplate`), readable by whoever may read BatchSandboxes in the
//! sandbox cluster: the capability is assignment-scoped (invariant 14), and no other secret
//! is passed.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use gdr_core::assignment::AssignmentId;
use gdr_core::backend::Backend;
use gdr_core::executor::{
    Binding, ExecutorBackend, ExecutorError, ExecutorRecord, ExecutorSpec, IdentityTarget,
    LocalWarmClaims, Phase, WarmClaims,
};
use gdr_core::identity::TrustDomain;
use gdr_core::metadata::{self, Marker, MetadataCodec, MetadataError};

use crate::warm::ClaimCounts;

use super::client::{
    ApiKey, ClientError, ClientSettings, CreateSandbox, LifecycleClient, ListQuery, MAX_PAGE_SIZE,
    MIN_TIMEOUT, Sandbox,
};

/// Configuration of the VM backend. Every field is one documented setting.
#[derive(Debug, Clone)]
pub struct OpenSandboxSettings {
    /// The Lifecycle API (`opensandbox_api`, base including `/v1`) and its timeouts
    /// (`opensandbox_request_timeout`, `opensandbox_create_timeout`).
    pub api: ClientSettings,
    /// The pool every sandbox comes from (`opensandbox_pool`, `extensions.poolRef`).
    pub pool: String,
    /// The command the sandbox runs, a path inside the pool's image
    /// (`vm_entrypoint`, default `["/usr/local/bin/gitea-dynamic-runner", "executor"]`).
    pub entrypoint: Vec<String>,
    /// Extra executor environment (`vm_executor_env`: `SPIFFE_ENDPOINT_SOCKET` of the agent
    /// in the VM, `GITEA_RUNNER_BINARY`, …); the `CI_*` variables of the assignment win.
    pub extra_env: BTreeMap<String, String>,
    /// Sandbox lifetime the server enforces (`vm_timeout_seconds`, ≥ 60 s, default 4 h);
    /// renewed while the job runs.
    pub timeout: Duration,
    /// Renew when the expiry is closer than this (`vm_renew_before`, default 10 min;
    /// below `timeout`).
    pub renew_before: Duration,
    /// Page size of lists (1..=200, default 200).
    pub page_size: u32,
    /// Warm sandboxes to keep ready (`vm_warm_pool`, default 0: none; the `warm`
    /// module).
    pub warm_pool: u32,
    /// A warm sandbox not running this long after its creation is replaced
    /// (`executor_start_deadline`).
    pub warm_start_deadline: Duration,
    /// A member held in the warm-claims arbiter this long while its metadata still reads
    /// unclaimed was left by a claimant that died, and is discarded (default
    /// [`crate::defaults::opensandbox::WARM_HOLD_GRACE`]; not a setting).
    pub warm_hold_grace: Duration,
    /// The metadata codec (its prefix).
    pub codec: MetadataCodec,
    /// Trust domain the recorded SPIFFE IDs must belong to.
    pub trust_domain: TrustDomain,
}

/// The warm pool's state in the backend (used by the `warm` module): the arbiter, the
/// members' static environment (known once the facade's URL is), and the claims counted
/// since the last pass.
pub(super) struct WarmState {
    pub(super) claims: Arc<dyn WarmClaims>,
    pub(super) environment: Mutex<Option<BTreeMap<String, String>>>,
    pub(super) counts: ClaimCounts,
}

impl Default for WarmState {
    fn default() -> Self {
        WarmState {
            claims: Arc::new(LocalWarmClaims::default()),
            environment: Mutex::new(None),
            counts: ClaimCounts::default(),
        }
    }
}

/// Why the settings cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("OpenSandbox settings: {0}")]
pub struct InvalidSettings(pub String);

impl OpenSandboxSettings {
    /// Settings with the defaults for everything but where the API is and which pool.
    pub fn new(
        api: ClientSettings,
        pool: impl Into<String>,
        codec: MetadataCodec,
        trust_domain: TrustDomain,
    ) -> Self {
        use crate::defaults::opensandbox as default;
        OpenSandboxSettings {
            api,
            pool: pool.into(),
            entrypoint: default::ENTRYPOINT
                .iter()
                .map(|a| (*a).to_owned())
                .collect(),
            extra_env: BTreeMap::new(),
            timeout: default::TIMEOUT,
            renew_before: default::RENEW_BEFORE,
            page_size: MAX_PAGE_SIZE,
            warm_pool: 0,
            warm_start_deadline: crate::defaults::executor::START_DEADLINE,
            warm_hold_grace: default::WARM_HOLD_GRACE,
            codec,
            trust_domain,
        }
    }

    /// Checks what the server would refuse later, and what would make renewals useless.
    pub fn validate(&self) -> Result<(), InvalidSettings> {
        let fail = |why: String| Err(InvalidSettings(why));
        if self.pool.is_empty() {
            return fail("opensandbox_pool is empty".into());
        }
        if self.entrypoint.is_empty() || self.entrypoint[0].is_empty() {
            return fail("vm_entrypoint is empty".into());
        }
        if self.timeout < MIN_TIMEOUT {
            return fail(format!(
                "vm_timeout_seconds is {}, OpenSandbox requires at least {}",
                self.timeout.as_secs(),
                MIN_TIMEOUT.as_secs()
            ));
        }
        if self.renew_before >= self.timeout {
            return fail(format!(
                "vm_renew_before ({:?}) must be below vm_timeout_seconds ({:?})",
                self.renew_before, self.timeout
            ));
        }
        if !(1..=MAX_PAGE_SIZE).contains(&self.page_size) {
            return fail(format!(
                "page size {} is outside 1..={MAX_PAGE_SIZE}",
                self.page_size
            ));
        }
        Ok(())
    }
}

/// Why a VM backend operation failed (wrapped in [`ExecutorError`]).
#[derive(Debug, thiserror::Error)]
pub enum OpenSandboxError {
    /// The Lifecycle API call failed.
    #[error("{0}")]
    Api(#[source] ClientError),
    /// The sandbox's metadata does not describe a valid assignment.
    #[error("sandbox {sandbox} has untrustworthy metadata: {source}")]
    Untrusted {
        /// The sandbox ID.
        sandbox: String,
        /// What is wrong.
        #[source]
        source: MetadataError,
    },
    /// The sandbox records a pod assignment.
    #[error("sandbox {sandbox} records backend {found}, this is the vm backend")]
    OtherBackend {
        /// The sandbox ID.
        sandbox: String,
        /// The recorded backend.
        found: Backend,
    },
    /// The assignment belongs to the pod backend.
    #[error("assignment {0} is for backend pod, this is the vm backend")]
    WrongBackend(AssignmentId),
    /// No sandbox exists for the assignment.
    #[error("no sandbox exists for assignment {0}")]
    NoExecutor(AssignmentId),
    /// The sandbox vanished while being bound.
    #[error("sandbox {0} is gone")]
    Gone(String),
    /// The sandbox's recorded SPIFFE ID is not the one of the record.
    #[error("sandbox {sandbox} records SPIFFE ID {found}, expected {expected}")]
    IdentityMismatch {
        /// The sandbox ID.
        sandbox: String,
        /// The SPIFFE ID on the sandbox.
        found: String,
        /// The SPIFFE ID of the record.
        expected: String,
    },
    /// The flattened metadata cannot be built.
    #[error("cannot encode the metadata of assignment {id}: {source}")]
    Encode {
        /// The assignment.
        id: AssignmentId,
        /// The cause.
        #[source]
        source: MetadataError,
    },
}

pub(super) fn api_error(error: ClientError) -> ExecutorError {
    match error {
        ClientError::PoolFull { retry_after, .. } => ExecutorError::Full {
            retry_after,
            source: Box::new(error),
        },
        ClientError::Invalid { .. } => ExecutorError::permanent(OpenSandboxError::Api(error)),
        other => ExecutorError::unavailable(OpenSandboxError::Api(other)),
    }
}

/// Executors as OpenSandbox sandboxes.
pub struct OpenSandboxBackend {
    pub(super) settings: OpenSandboxSettings,
    pub(super) client: LifecycleClient,
    /// Assignment → sandbox ID, learnt from validated sandboxes; saves a list before each
    /// marker patch. Only an optimisation: a stale entry answers 404 and is looked up again.
    ids: Mutex<HashMap<AssignmentId, String>>,
    /// The warm pool's arbiter, its standby environment and its claim counts.
    pub(super) warm: WarmState,
}

impl std::fmt::Debug for OpenSandboxBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenSandboxBackend")
            .field("pool", &self.settings.pool)
            .field("client", &self.client)
            .finish_non_exhaustive()
    }
}

impl OpenSandboxBackend {
    /// A backend over `client` with validated `settings`.
    pub fn new(
        settings: OpenSandboxSettings,
        client: LifecycleClient,
    ) -> Result<Self, InvalidSettings> {
        settings.validate()?;
        Ok(OpenSandboxBackend {
            settings,
            client,
            ids: Mutex::new(HashMap::new()),
            warm: WarmState::default(),
        })
    }

    /// A backend with its own client of `settings.api`, authenticating with `api_key` and
    /// using `tls` (the shared rustls configuration) for https.
    pub fn connect(
        settings: OpenSandboxSettings,
        api_key: &ApiKey,
        tls: rustls::ClientConfig,
    ) -> Result<Self, ExecutorError> {
        let client = LifecycleClient::new(settings.api.clone(), api_key, tls)
            .map_err(|e| ExecutorError::permanent(OpenSandboxError::Api(e)))?;
        Self::new(settings, client).map_err(ExecutorError::permanent)
    }

    /// The settings it was built with.
    pub fn settings(&self) -> &OpenSandboxSettings {
        &self.settings
    }

    /// The Lifecycle API client.
    pub fn client(&self) -> &LifecycleClient {
        &self.client
    }

    pub(super) fn ids(&self) -> std::sync::MutexGuard<'_, HashMap<AssignmentId, String>> {
        self.ids.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn query(&self, key: &str, value: &str) -> ListQuery {
        ListQuery {
            metadata: BTreeMap::from([(self.settings.codec.key(key), value.to_owned())]),
            states: Vec::new(),
            page_size: self.settings.page_size,
        }
    }

    /// The record a sandbox's metadata describes, re-validated.
    pub(super) fn record(&self, sandbox: &Sandbox) -> Result<ExecutorRecord, OpenSandboxError> {
        let codec = &self.settings.codec;
        let untrusted = |source| OpenSandboxError::Untrusted {
            sandbox: sandbox.id.clone(),
            source,
        };
        let metadata = codec.unflatten(&sandbox.metadata()).map_err(untrusted)?;
        let assignment = codec
            .decode(&metadata, &self.settings.trust_domain)
            .map_err(untrusted)?;
        if assignment.backend() != Backend::Vm {
            return Err(OpenSandboxError::OtherBackend {
                sandbox: sandbox.id.clone(),
                found: assignment.backend(),
            });
        }
        let phase = phase(sandbox);
        Ok(ExecutorRecord {
            name: sandbox.id.clone(),
            claimed: codec.has_marker(&metadata.labels, Marker::Claimed),
            terminal: codec.has_marker(&metadata.labels, Marker::Terminal),
            identity_bound: phase == Phase::Running,
            identity_target: Some(IdentityTarget::SandboxId(sandbox.id.clone())),
            // A claimed warm member starts as the job's executor at its claim.
            created_at: self.claimed_at(sandbox).unwrap_or(sandbox.created_at),
            assignment,
            phase,
        })
    }

    /// Every sandbox labelled with `id`, oldest first (IDs break ties), validated.
    /// Normally one; a second can exist only after a create whose answer was lost raced a
    /// redelivery, and the oldest is then the one every call uses.
    async fn sandboxes_of(
        &self,
        id: &AssignmentId,
    ) -> Result<Vec<(Sandbox, ExecutorRecord)>, ExecutorError> {
        let mut sandboxes = self
            .client
            .list(&self.query(metadata::keys::ASSIGNMENT_ID, id.as_str()))
            .await
            .map_err(api_error)?;
        sandboxes.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        let mut found = Vec::with_capacity(sandboxes.len());
        for sandbox in sandboxes {
            let record = self.record(&sandbox).map_err(ExecutorError::permanent)?;
            if record.assignment.id() != id {
                // The filter matched the label, so the metadata contradicts itself.
                return Err(ExecutorError::permanent(OpenSandboxError::Untrusted {
                    sandbox: sandbox.id.clone(),
                    source: MetadataError::AssignmentIdMismatch {
                        found: record.assignment.id().to_string(),
                        expected: id.to_string(),
                    },
                }));
            }
            found.push((sandbox, record));
        }
        if found.len() > 1 {
            tracing::warn!(assignment_id = %id, sandboxes = ?found.iter().map(|(s, _)| &s.id).collect::<Vec<_>>(), "several sandboxes carry one assignment; using the oldest, deleting the assignment deletes all");
        }
        Ok(found)
    }

    /// Sets `marker` on the assignment's sandbox; `false` when no sandbox exists.
    async fn set_marker(&self, id: &AssignmentId, marker: Marker) -> Result<bool, ExecutorError> {
        let (key, value) = self.settings.codec.marker(marker);
        let patch = BTreeMap::from([(key.clone(), Some(value.clone()))]);
        let cached = self.ids().get(id).cloned();
        let sandbox_id = match cached {
            Some(sandbox_id) => sandbox_id,
            None => match self.find(id).await? {
                Some(record) => record.name,
                None => return Ok(false),
            },
        };
        let patched = match self.client.patch_metadata(&sandbox_id, &patch).await {
            Ok(sandbox) => sandbox,
            Err(ClientError::NotFound { .. }) => {
                // The cached sandbox is gone; another may carry the assignment.
                self.ids().remove(id);
                let Some(record) = self.find(id).await? else {
                    return Ok(false);
                };
                match self.client.patch_metadata(&record.name, &patch).await {
                    Ok(sandbox) => sandbox,
                    Err(ClientError::NotFound { .. }) => return Ok(false),
                    Err(e) => return Err(api_error(e)),
                }
            }
            Err(e) => return Err(api_error(e)),
        };
        if patched.metadata().get(&key) != Some(&value) {
            return Err(ExecutorError::unavailable(OpenSandboxError::Api(
                ClientError::Config(format!(
                    "sandbox {} did not keep metadata {key}={value}",
                    patched.id
                )),
            )));
        }
        Ok(true)
    }

    /// Extends the expiry of a non-terminal sandbox that expires within `renew_before`.
    async fn renew_if_due(&self, sandbox: &Sandbox, record: &ExecutorRecord) {
        if record.terminal || record.phase.is_finished() {
            return;
        }
        match self.renew_due(sandbox).await {
            None => {}
            Some(Ok(until)) => {
                tracing::info!(assignment_id = %record.assignment.id(), sandbox = %sandbox.id, until = ?until, "extended the sandbox expiry");
            }
            Some(Err(e)) => {
                tracing::warn!(assignment_id = %record.assignment.id(), sandbox = %sandbox.id, error = %e, "cannot extend the sandbox expiry; retrying on the next pass");
            }
        }
    }

    /// Extends `sandbox`'s expiry to `timeout` from now when it expires within
    /// `renew_before` (an executor's, a warm member's); `None`: not due.
    pub(super) async fn renew_due(
        &self,
        sandbox: &Sandbox,
    ) -> Option<Result<SystemTime, ClientError>> {
        let expires_at = sandbox.expires_at?;
        let now = SystemTime::now();
        let left = expires_at.duration_since(now).unwrap_or(Duration::ZERO);
        if left >= self.settings.renew_before {
            return None;
        }
        Some(
            self.client
                .renew_expiration(&sandbox.id, now + self.settings.timeout)
                .await,
        )
    }
}

/// The executor phase a sandbox state means.
pub(super) fn phase(sandbox: &Sandbox) -> Phase {
    let status = &sandbox.status;
    let reason = || {
        let parts: Vec<&str> = [status.reason.as_deref(), status.message.as_deref()]
            .into_iter()
            .flatten()
            .collect();
        Some(format!("sandbox {}: {}", status.state, parts.join(": ")))
    };
    match status.state.to_ascii_lowercase().as_str() {
        // Whether the executor still runs is not visible here (an exited one stays
        // Running); pausing is nothing this project does.
        "running" | "pausing" | "paused" | "resuming" => Phase::Running,
        "pending" | "allocated" => Phase::Starting { reason: reason() },
        "stopping" | "terminated" | "failed" => Phase::Finished {
            success: false,
            reason: reason(),
        },
        _ => Phase::Starting {
            reason: Some(format!("unknown sandbox state {:?}", status.state)),
        },
    }
}

#[async_trait]
impl ExecutorBackend for OpenSandboxBackend {
    fn backend(&self) -> Backend {
        Backend::Vm
    }

    async fn find(&self, id: &AssignmentId) -> Result<Option<ExecutorRecord>, ExecutorError> {
        let found = self.sandboxes_of(id).await?;
        let Some((sandbox, record)) = found.into_iter().next() else {
            self.ids().remove(id);
            return Ok(None);
        };
        self.ids().insert(id.clone(), sandbox.id);
        Ok(Some(record))
    }

    async fn create(&self, spec: &ExecutorSpec) -> Result<ExecutorRecord, ExecutorError> {
        let id = spec.assignment.id();
        if spec.assignment.backend() != Backend::Vm {
            return Err(ExecutorError::permanent(OpenSandboxError::WrongBackend(
                id.clone(),
            )));
        }
        if let Some(existing) = self.find(id).await? {
            return Ok(existing);
        }
        let metadata = self
            .settings
            .codec
            .flatten(&spec.metadata)
            .map_err(|source| {
                ExecutorError::permanent(OpenSandboxError::Encode {
                    id: id.clone(),
                    source,
                })
            })?;
        if let Some(claimed) = self.claim_warm(spec, &metadata).await? {
            return Ok(claimed);
        }
        let mut env = self.settings.extra_env.clone();
        env.extend(
            spec.environment()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v)),
        );
        let request = CreateSandbox {
            pool: self.settings.pool.clone(),
            entrypoint: self.settings.entrypoint.clone(),
            env,
            metadata,
            timeout: Some(self.settings.timeout),
        };
        tracing::info!(assignment_id = %id, pool = %self.settings.pool, "creating sandbox (blocks until it runs)");
        let sandbox = self.client.create(&request).await.map_err(api_error)?;
        let record = self.record(&sandbox).map_err(ExecutorError::permanent)?;
        self.ids().insert(id.clone(), sandbox.id.clone());
        tracing::info!(assignment_id = %id, sandbox = %sandbox.id, state = %sandbox.status.state, "sandbox created");
        Ok(record)
    }

    async fn bind_identity(&self, record: &ExecutorRecord) -> Result<Binding, ExecutorError> {
        let sandbox = self
            .client
            .get(&record.name)
            .await
            .map_err(api_error)?
            .ok_or_else(|| {
                ExecutorError::unavailable(OpenSandboxError::Gone(record.name.clone()))
            })?;
        let current = self.record(&sandbox).map_err(ExecutorError::permanent)?;
        let (found, expected) = (
            current.assignment.identity().spiffe_id(),
            record.assignment.identity().spiffe_id(),
        );
        if found != expected {
            return Err(ExecutorError::permanent(
                OpenSandboxError::IdentityMismatch {
                    sandbox: sandbox.id,
                    found: found.to_owned(),
                    expected: expected.to_owned(),
                },
            ));
        }
        Ok(match current.phase {
            Phase::Running => Binding::Bound,
            Phase::Starting { reason } | Phase::Finished { reason, .. } => Binding::NotReady(
                reason.unwrap_or_else(|| format!("sandbox {} is not running", sandbox.id)),
            ),
        })
    }

    async fn record_claimed(&self, id: &AssignmentId) -> Result<(), ExecutorError> {
        if self.set_marker(id, Marker::Claimed).await? {
            Ok(())
        } else {
            Err(ExecutorError::unavailable(OpenSandboxError::NoExecutor(
                id.clone(),
            )))
        }
    }

    async fn mark_terminal(&self, id: &AssignmentId) -> Result<(), ExecutorError> {
        self.set_marker(id, Marker::Terminal).await.map(|_| ())
    }

    async fn list(&self) -> Result<Vec<ExecutorRecord>, ExecutorError> {
        let sandboxes = self
            .client
            .list(&self.query(metadata::keys::RUNNER, metadata::TRUE))
            .await
            .map_err(api_error)?;
        let mut by_assignment: BTreeMap<AssignmentId, (Sandbox, ExecutorRecord)> = BTreeMap::new();
        for sandbox in sandboxes {
            let record = match self.record(&sandbox) {
                Ok(record) => record,
                Err(e) => {
                    tracing::warn!(sandbox = %sandbox.id, error = %e, "skipping a sandbox with corrupt or tampered metadata");
                    continue;
                }
            };
            let id = record.assignment.id().clone();
            let older = |(s, _): &(Sandbox, ExecutorRecord)| {
                (s.created_at, &s.id) < (sandbox.created_at, &sandbox.id)
            };
            match by_assignment.get(&id) {
                Some(kept) if older(kept) => {
                    tracing::warn!(assignment_id = %id, kept = %kept.0.id, duplicate = %sandbox.id, "several sandboxes carry one assignment; using the oldest");
                }
                _ => {
                    by_assignment.insert(id, (sandbox, record));
                }
            }
        }
        let mut records = Vec::with_capacity(by_assignment.len());
        let mut ids = HashMap::with_capacity(by_assignment.len());
        for (id, (sandbox, record)) in by_assignment {
            self.renew_if_due(&sandbox, &record).await;
            ids.insert(id, sandbox.id);
            records.push(record);
        }
        self.ids().extend(ids);
        Ok(records)
    }

    async fn claimed_standby(
        &self,
        standby_id: &str,
    ) -> Result<Option<ExecutorRecord>, ExecutorError> {
        self.claimed_standby_record(standby_id).await
    }

    async fn delete(&self, id: &AssignmentId) -> Result<(), ExecutorError> {
        // A sandbox with untrustworthy metadata still carries the label; delete it too
        // (it is ours to clean up, and nothing is signalled from its metadata).
        let sandboxes = self
            .client
            .list(&self.query(metadata::keys::ASSIGNMENT_ID, id.as_str()))
            .await
            .map_err(api_error)?;
        for sandbox in sandboxes {
            if self.client.delete(&sandbox.id).await.map_err(api_error)? {
                tracing::info!(assignment_id = %id, sandbox = %sandbox.id, "sandbox deleted");
            }
        }
        self.ids().remove(id);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::opensandbox::client::{ApiError, SandboxStatus};

    fn api() -> ApiError {
        ApiError {
            code: Some("X".into()),
            message: "the server's words".into(),
        }
    }

    #[test]
    fn status_classes_map_to_what_the_worker_must_do() {
        let full = api_error(ClientError::PoolFull {
            retry_after: Some(Duration::from_secs(7)),
            api: api(),
        });
        assert!(
            matches!(full, ExecutorError::Full { retry_after: Some(d), .. } if d == Duration::from_secs(7))
        );
        let invalid = api_error(ClientError::Invalid {
            op: "create",
            status: 422,
            api: api(),
        });
        assert!(matches!(invalid, ExecutorError::Permanent(_)));
        assert!(
            invalid.to_string().contains("the server's words"),
            "{invalid}"
        );
        for retried in [
            ClientError::CreateTimedOut { api: api() },
            ClientError::Unauthorized {
                op: "list",
                status: 403,
                api: api(),
            },
            ClientError::PoolNotFound {
                pool: "p".into(),
                api: api(),
            },
            ClientError::Status {
                op: "get",
                status: 503,
                api: api(),
            },
        ] {
            let text = retried.to_string();
            let mapped = api_error(retried);
            assert!(matches!(mapped, ExecutorError::Unavailable(_)), "{text}");
            assert!(mapped.to_string().contains(&text), "{mapped}");
        }
    }

    fn sandbox(state: &str) -> Sandbox {
        Sandbox {
            id: "s".into(),
            status: SandboxStatus {
                state: state.into(),
                reason: Some("R".into()),
                message: Some("m".into()),
            },
            created_at: SystemTime::UNIX_EPOCH,
            expires_at: None,
            metadata: None,
        }
    }

    #[test]
    fn sandbox_states_map_to_phases() {
        assert_eq!(phase(&sandbox("Running")), Phase::Running);
        assert!(matches!(phase(&sandbox("Pending")), Phase::Starting { .. }));
        for ended in ["Failed", "Terminated", "Stopping"] {
            assert!(
                matches!(phase(&sandbox(ended)), Phase::Finished { success: false, reason: Some(r) } if r.contains(ended) && r.contains("R: m")),
                "{ended}"
            );
        }
    }

    #[test]
    fn settings_the_server_would_refuse_are_refused_early() {
        let base = OpenSandboxSettings::new(
            ClientSettings::new("http://127.0.0.1:1/v1".parse().unwrap()),
            "ci-vm",
            MetadataCodec::default(),
            TrustDomain::new("example.org").unwrap(),
        );
        assert!(base.validate().is_ok());
        let mut s = base.clone();
        s.timeout = Duration::from_secs(59);
        assert!(s.validate().is_err());
        let mut s = base.clone();
        s.renew_before = s.timeout;
        assert!(s.validate().is_err());
        let mut s = base.clone();
        s.pool.clear();
        assert!(s.validate().is_err());
        let mut s = base;
        s.page_size = 201;
        assert!(s.validate().is_err());
    }
}
