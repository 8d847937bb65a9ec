//! RBAC as the API server's authorizer applies it, from the manifests the project ships.
//!
//! A client that presents the bearer token of a [`ServiceAccount`] (see
//! [`super::RunningFakeKube::client_as`]) is that account's user
//! (`system:serviceaccount:<namespace>:<name>`), and each of its requests must be allowed by
//! a rule of a Role bound to it in the request's namespace (a RoleBinding) or of a
//! ClusterRole bound to it cluster-wide (a ClusterRoleBinding); otherwise the answer is the
//! real server's `403 Forbidden`. A request without a token is the test's own (cluster
//! admin) and is not checked: the test kit's peers (the fake kubelet, the fake SPIRE agent,
//! test set-up) act as the cluster's own components would.
//!
//! [`Rbac::shipped`] reads the Roles, ClusterRoles and bindings of `kubectl kustomize
//! deploy/kubernetes/base` and `deploy/kubernetes/sandbox-identity`, so a grant the code
//! needs and the manifests lack fails the test that makes the call; the fake records which
//! grants allowed a request ([`super::FakeKube::unused_grants`]), so a grant no call needs
//! can be found too.

use std::path::Path;
use std::sync::OnceLock;

use serde_json::Value;

/// A ServiceAccount, as the token a client presents names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceAccount {
    pub namespace: String,
    pub name: String,
}

const TOKEN_PREFIX: &str = "fake-kube-serviceaccount:";

impl ServiceAccount {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        ServiceAccount {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// The controller's account in the shipped base (`deploy/kubernetes/base`).
    pub fn controller() -> Self {
        Self::new("gitea-actions", "gitea-dynamic-runner")
    }

    /// sandbox-identity's account (`deploy/kubernetes/sandbox-identity`).
    pub fn sandbox_identity() -> Self {
        Self::new("opensandbox", "sandbox-identity")
    }

    /// The user name the API server gives the account.
    pub fn user(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.namespace, self.name)
    }

    /// The bearer token the fake recognises as this account.
    pub fn token(&self) -> String {
        format!("{TOKEN_PREFIX}{}:{}", self.namespace, self.name)
    }

    /// The account a token names, if it is one of the fake's.
    pub fn from_token(token: &str) -> Option<Self> {
        let (ns, name) = token.strip_prefix(TOKEN_PREFIX)?.split_once(':')?;
        Some(Self::new(ns, name))
    }
}

/// One (rule × verb × resource × group) a binding grants a user.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Grant {
    /// `system:serviceaccount:<ns>:<name>`.
    pub user: String,
    /// The namespace of the RoleBinding; `None` for a ClusterRoleBinding (everywhere).
    pub namespace: Option<String>,
    pub group: String,
    /// Resource, `resource/subresource`, or `*`.
    pub resource: String,
    pub verb: String,
    /// `resourceNames` of the rule (empty: any).
    pub resource_names: Vec<String>,
    /// Where it comes from (`Role gitea-actions/gitea-dynamic-runner`).
    pub source: String,
}

impl std::fmt::Display for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() {
            "\"\"".to_owned()
        } else {
            self.group.clone()
        };
        let scope = match &self.namespace {
            Some(ns) => format!("in namespace {ns}"),
            None => "cluster-wide".to_owned(),
        };
        write!(
            f,
            "{} {} (group {group}) {scope} to {} (from {})",
            self.verb, self.resource, self.user, self.source
        )
    }
}

/// What a request asks, as the authorizer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attributes {
    pub user: String,
    pub verb: String,
    pub group: String,
    /// `pods`, or `pods/status` for a subresource.
    pub resource: String,
    /// The plural alone (for the message's head).
    pub plural: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

/// Why the shipped RBAC could not be read.
#[derive(Debug, thiserror::Error)]
pub enum RbacError {
    #[error("running `kubectl kustomize {dir}` (kubectl must be installed): {source}")]
    Kubectl {
        dir: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`kubectl kustomize {dir}` failed: {stderr}")]
    Render { dir: String, stderr: String },
    #[error("parsing the rendered {dir}: {message}")]
    Parse { dir: String, message: String },
    #[error("{0}")]
    Manifest(String),
}

/// The grants the authorizer checks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rbac {
    grants: Vec<Grant>,
}

/// The kustomizations whose RBAC the fake enforces, relative to the workspace root.
pub const SHIPPED: [&str; 2] = [
    "deploy/kubernetes/base",
    "deploy/kubernetes/sandbox-identity",
];

static SHIPPED_RBAC: OnceLock<Result<Rbac, String>> = OnceLock::new();

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(str::to_owned)
        .collect()
}

/// Renders a kustomization of the workspace into its objects.
pub fn render(dir: &str) -> Result<Vec<Value>, RbacError> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(dir);
    let out = std::process::Command::new("kubectl")
        .arg("kustomize")
        .arg(&path)
        .output()
        .map_err(|source| RbacError::Kubectl {
            dir: dir.to_owned(),
            source,
        })?;
    if !out.status.success() {
        return Err(RbacError::Render {
            dir: dir.to_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    let text = String::from_utf8_lossy(&out.stdout);
    serde_saphyr::from_multiple::<Value>(&text).map_err(|e| RbacError::Parse {
        dir: dir.to_owned(),
        message: e.to_string(),
    })
}

impl Rbac {
    /// The RBAC of the shipped manifests ([`SHIPPED`]), rendered once per process.
    pub fn shipped() -> Result<Rbac, String> {
        SHIPPED_RBAC
            .get_or_init(|| {
                let mut objects = Vec::new();
                for dir in SHIPPED {
                    objects.extend(render(dir).map_err(|e| e.to_string())?);
                }
                Rbac::from_objects(&objects).map_err(|e| e.to_string())
            })
            .clone()
    }

    /// The grants of the Roles, ClusterRoles and their bindings among `objects`.
    pub fn from_objects(objects: &[Value]) -> Result<Rbac, RbacError> {
        let find = |kind: &str, namespace: Option<&str>, name: &str| {
            objects.iter().find(|o| {
                o["kind"] == kind
                    && o["metadata"]["name"] == name
                    && namespace.is_none_or(|ns| o["metadata"]["namespace"] == ns)
            })
        };
        let mut grants = Vec::new();
        for binding in objects.iter().filter(|o| {
            matches!(
                o["kind"].as_str(),
                Some("RoleBinding" | "ClusterRoleBinding")
            )
        }) {
            let cluster = binding["kind"] == "ClusterRoleBinding";
            let binding_ns = binding["metadata"]["namespace"].as_str();
            let role_ref = &binding["roleRef"];
            let role_kind = role_ref["kind"].as_str().unwrap_or_default();
            let role_name = role_ref["name"].as_str().unwrap_or_default();
            let role = match role_kind {
                "Role" if !cluster => find("Role", binding_ns, role_name),
                "ClusterRole" => find("ClusterRole", None, role_name),
                other => {
                    return Err(RbacError::Manifest(format!(
                        "{} {} refers to a {other}, which it cannot bind",
                        binding["kind"], binding["metadata"]["name"]
                    )));
                }
            }
            .ok_or_else(|| {
                RbacError::Manifest(format!(
                    "{} {} binds {role_kind} {role_name}, which the manifests do not define",
                    binding["kind"], binding["metadata"]["name"]
                ))
            })?;
            let source = match role["metadata"]["namespace"].as_str() {
                Some(ns) => format!("{role_kind} {ns}/{role_name}"),
                None => format!("{role_kind} {role_name}"),
            };
            let namespace = if cluster {
                None
            } else {
                Some(binding_ns.unwrap_or_default().to_owned())
            };
            for subject in binding["subjects"].as_array().into_iter().flatten() {
                if subject["kind"] != "ServiceAccount" {
                    continue;
                }
                let sa = ServiceAccount::new(
                    subject["namespace"]
                        .as_str()
                        .or(binding_ns)
                        .unwrap_or_default(),
                    subject["name"].as_str().unwrap_or_default(),
                );
                for rule in role["rules"].as_array().into_iter().flatten() {
                    for group in strings(&rule["apiGroups"]) {
                        for resource in strings(&rule["resources"]) {
                            for verb in strings(&rule["verbs"]) {
                                grants.push(Grant {
                                    user: sa.user(),
                                    namespace: namespace.clone(),
                                    group: group.clone(),
                                    resource: resource.clone(),
                                    verb,
                                    resource_names: strings(&rule["resourceNames"]),
                                    source: source.clone(),
                                });
                            }
                        }
                    }
                }
            }
        }
        grants.sort();
        grants.dedup();
        Ok(Rbac { grants })
    }

    /// The same, with every grant of namespace `from` also made in `to`, as an operator
    /// who deploys the executors to another namespace applies the Role there too.
    pub fn also_in(mut self, from: &str, to: &str) -> Rbac {
        let copies: Vec<Grant> = self
            .grants
            .iter()
            .filter(|g| g.namespace.as_deref() == Some(from))
            .map(|g| Grant {
                namespace: Some(to.to_owned()),
                source: format!("{} (applied to namespace {to})", g.source),
                ..g.clone()
            })
            .collect();
        self.grants.extend(copies);
        self
    }

    /// Every grant.
    pub fn grants(&self) -> &[Grant] {
        &self.grants
    }

    /// The index of the first grant allowing `a`, if any.
    pub fn authorize(&self, a: &Attributes) -> Option<usize> {
        self.grants.iter().position(|g| {
            g.user == a.user
                && (g.verb == a.verb || g.verb == "*")
                && (g.group == a.group || g.group == "*")
                && (g.resource == a.resource || g.resource == "*")
                && match (&g.namespace, &a.namespace) {
                    (None, _) => true,
                    (Some(granted), Some(asked)) => granted == asked,
                    (Some(_), None) => false,
                }
                && (g.resource_names.is_empty()
                    || a.name
                        .as_ref()
                        .is_some_and(|n| g.resource_names.contains(n)))
        })
    }
}

/// The real server's message for a denied request.
pub fn forbidden_message(a: &Attributes) -> String {
    let qualified = if a.group.is_empty() {
        a.plural.clone()
    } else {
        format!("{}.{}", a.plural, a.group)
    };
    let head = match &a.name {
        Some(name) => format!("{qualified} {name:?} is forbidden"),
        None => format!("{qualified} is forbidden"),
    };
    let scope = match &a.namespace {
        Some(ns) => format!("in the namespace {ns:?}"),
        None => "at the cluster scope".to_owned(),
    };
    format!(
        "{head}: User {:?} cannot {} resource {:?} in API group {:?} {scope}",
        a.user, a.verb, a.resource, a.group
    )
}
