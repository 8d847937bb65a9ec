//! Errors of the Pod backend, the table of every Kubernetes API call it makes, and how
//! Kubernetes answers map onto the backend contract.

use gdr_core::assignment::AssignmentId;
use gdr_core::backend::Backend;
use gdr_core::executor::ExecutorError;
use gdr_core::metadata::MetadataError;

use super::settings::SettingsError;

/// One kind of API request, as RBAC names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiCall {
    /// RBAC verb.
    pub verb: &'static str,
    /// API group (`""` for core).
    pub group: &'static str,
    /// Resource (plural), with `/subresource` when one is used.
    pub resource: &'static str,
    /// Whether the call is made in the executor namespace (else cluster-scoped).
    pub namespaced: bool,
}

macro_rules! calls {
    ($($name:ident = $verb:literal $group:literal $resource:literal $ns:literal;)*) => {
        $(
            #[doc = concat!("`", $verb, "` on `", $group, "/", $resource, "`.")]
            pub const $name: ApiCall = ApiCall { verb: $verb, group: $group, resource: $resource, namespaced: $ns };
        )*
        /// Every API call the Pod backend makes: the RBAC manifest must grant each one.
        pub const API_CALLS: &[ApiCall] = &[$($name),*];
    };
}

calls! {
    GET_POD = "get" "" "pods" true;
    LIST_PODS = "list" "" "pods" true;
    WATCH_PODS = "watch" "" "pods" true;
    CREATE_POD = "create" "" "pods" true;
    PATCH_POD = "patch" "" "pods" true;
    DELETE_POD = "delete" "" "pods" true;
    CREATE_SECRET = "create" "" "secrets" true;
    PATCH_SECRET = "patch" "" "secrets" true;
    LIST_SECRETS = "list" "" "secrets" true;
    DELETE_SECRET = "delete" "" "secrets" true;
    GET_NODE = "get" "" "nodes" false;
    GET_ENTRY = "get" "spire.spiffe.io" "clusterstaticentries" false;
    LIST_ENTRIES = "list" "spire.spiffe.io" "clusterstaticentries" false;
    CREATE_ENTRY = "create" "spire.spiffe.io" "clusterstaticentries" false;
    DELETE_ENTRY = "delete" "spire.spiffe.io" "clusterstaticentries" false;
}

impl std::fmt::Display for ApiCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.group.is_empty() {
            write!(f, "{} {}", self.verb, self.resource)
        } else {
            write!(f, "{} {}.{}", self.verb, self.resource, self.group)
        }
    }
}

/// Why a Pod-backend operation failed.
#[derive(Debug, thiserror::Error)]
pub enum KubernetesError {
    /// The API server answered with an error, or could not be reached.
    #[error("Kubernetes API: {call} {name}: {source}")]
    Api {
        /// The request.
        call: ApiCall,
        /// The object named (or the namespace).
        name: String,
        /// The client's error.
        #[source]
        source: Box<kube::Error>,
    },
    /// RBAC refused a request: a configuration error naming what to grant.
    #[error(
        "the controller's service account may not {call} (RBAC: grant verb {verb:?} on resource {resource:?} of API group {group:?}{scope}): {source}",
        verb = call.verb, resource = call.resource, group = call.group,
        scope = if call.namespaced { format!(" in namespace {namespace:?}") } else { " (cluster-wide)".to_owned() }
    )]
    Forbidden {
        /// The refused request.
        call: ApiCall,
        /// The executor namespace.
        namespace: String,
        /// The server's answer.
        #[source]
        source: Box<kube::Error>,
    },
    /// The API server refused the object as invalid (422).
    #[error("Kubernetes refused {call} {name} as invalid: {source}")]
    Invalid {
        /// The request.
        call: ApiCall,
        /// The object.
        name: String,
        /// The server's answer, with its message.
        #[source]
        source: Box<kube::Error>,
    },
    /// The Pod's labels and annotations do not describe a valid assignment.
    #[error("Pod {pod} has untrustworthy metadata: {source}")]
    Untrusted {
        /// The Pod.
        pod: String,
        /// What is wrong.
        #[source]
        source: MetadataError,
    },
    /// A Pod named after an assignment records another assignment or backend.
    #[error("Pod {pod} records {found}, not this backend's assignment {id}")]
    NotOurs {
        /// The Pod.
        pod: String,
        /// What it records.
        found: String,
        /// The assignment looked for.
        id: AssignmentId,
    },
    /// The assignment belongs to another backend.
    #[error("assignment {id} is for backend {requested}, this backend is pod")]
    WrongBackend {
        /// The assignment.
        id: AssignmentId,
        /// Its backend.
        requested: Backend,
    },
    /// A `runs-on` label selects no profile.
    #[error("runs-on label {label:?} selects no Pod profile (known profiles: {known})")]
    UnknownProfileLabel {
        /// The label.
        label: String,
        /// The configured profiles.
        known: String,
    },
    /// Two `runs-on` labels select a profile each.
    #[error("runs-on labels {first:?} and {second:?} select two Pod profiles; a job may use one")]
    TwoProfiles {
        /// One.
        first: String,
        /// The other.
        second: String,
    },
    /// The identity entry exists with another spec; it is never re-pointed.
    #[error(
        "ClusterStaticEntry {name} exists with another spec ({existing}), expected {wanted}; refusing to re-point it"
    )]
    EntryMismatch {
        /// The entry.
        name: String,
        /// Its spec.
        existing: String,
        /// The spec this backend would write.
        wanted: String,
    },
    /// No executor Pod exists for the assignment.
    #[error("no executor Pod {name}")]
    NoExecutor {
        /// The Pod name.
        name: String,
    },
    /// The settings cannot work.
    #[error("Pod backend settings: {0}")]
    Settings(#[from] SettingsError),
    /// An object could not be (de)serialised.
    #[error("encoding {what}: {source}")]
    Encoding {
        /// What.
        what: &'static str,
        /// Cause.
        #[source]
        source: serde_json::Error,
    },
}

impl KubernetesError {
    /// The contract's view: retry or give up.
    pub fn into_executor_error(self) -> ExecutorError {
        match &self {
            KubernetesError::Api { source, .. } => match source.as_ref() {
                kube::Error::Api(status) if matches!(status.code, 400 | 404 | 405 | 415) => {
                    ExecutorError::permanent(self)
                }
                // 409 conflict, 429, 5xx, 401 (token rotation), transport: retry.
                _ => ExecutorError::unavailable(self),
            },
            KubernetesError::NoExecutor { .. } => ExecutorError::unavailable(self),
            _ => ExecutorError::permanent(self),
        }
    }
}

impl From<KubernetesError> for ExecutorError {
    fn from(e: KubernetesError) -> Self {
        e.into_executor_error()
    }
}

/// Classifies a client error of `call` on `name` (403 and 422 get their own variants).
pub(super) fn api(
    call: ApiCall,
    name: &str,
    namespace: &str,
    source: kube::Error,
) -> KubernetesError {
    match &source {
        kube::Error::Api(s) if s.code == 403 => KubernetesError::Forbidden {
            call,
            namespace: namespace.to_owned(),
            source: Box::new(source),
        },
        kube::Error::Api(s) if s.code == 422 => KubernetesError::Invalid {
            call,
            name: name.to_owned(),
            source: Box::new(source),
        },
        _ => KubernetesError::Api {
            call,
            name: name.to_owned(),
            source: Box::new(source),
        },
    }
}

/// Whether the error is a 404.
pub(super) fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// Whether the error is a 409 `AlreadyExists`.
pub(super) fn is_already_exists(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409 && s.reason == "AlreadyExists")
}
