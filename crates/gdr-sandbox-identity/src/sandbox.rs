//! Reading a runner `BatchSandbox` (pure): which Pods it holds now, which identity it
//! asks for, and the `ClusterStaticEntry` each such Pod gets.
//!
//! Everything on the object is written by others (the OpenSandbox server and pool
//! controller, whoever holds the OpenSandbox key), so nothing is taken as it is: pod names
//! must be DNS names, a malformed release annotation releases every Pod (fail closed), and
//! the SPIFFE ID is re-validated by the domain rules (and must agree with the sandbox's
//! metadata where that is present).

use std::collections::{BTreeMap, BTreeSet};

use gdr_core::backend::Backend;
use gdr_core::identity::{TrustDomain, check_job_spiffe_id};
use gdr_core::metadata::{MetadataCodec, keys};
use serde_json::{Value, json};

/// Annotation of the pool controller naming the sandbox's Pods.
pub const ALLOC_STATUS: &str = "sandbox.opensandbox.io/alloc-status";
/// Annotations naming Pods being released or released (not to be identified any more).
pub const ALLOC_RELEASE: [&str; 2] = [
    "sandbox.opensandbox.io/alloc-release",
    "sandbox.opensandbox.io/alloc-released",
];
/// The environment variable carrying the job's SPIFFE ID.
pub const SPIFFE_ID_ENV: &str = gdr_core::executor::env::SPIFFE_ID;

/// Label of every entry this reconciler owns (the same as the Python version's, so a
/// takeover adopts and cleans up its entries).
pub const COMPONENT_LABEL: (&str, &str) = ("app.kubernetes.io/component", "opensandbox-identity");
/// The `app.kubernetes.io/name` label of the entries.
pub const NAME_LABEL: (&str, &str) = ("app.kubernetes.io/name", "gitea-dynamic-runner");
/// Label (after the metadata prefix) naming the entry's sandbox.
pub const SANDBOX_ID_LABEL: &str = "sandbox-id";
/// Label (after the metadata prefix) naming the entry's Pod UID.
pub const POD_UID_LABEL: &str = "pod-uid";

/// Why a sandbox gets no identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Neither `CI_SPIFFE_ID` nor decodable metadata names an identity.
    #[error(
        "the sandbox names no SPIFFE ID (no {SPIFFE_ID_ENV} in its task, no identity metadata)"
    )]
    NoIdentity,
    /// `CI_SPIFFE_ID` is not a job SPIFFE ID of the trust domain.
    #[error("{0}")]
    InvalidSpiffeId(#[from] gdr_core::identity::InvalidJobSpiffeId),
    /// The identity metadata is present but does not validate.
    #[error("its identity metadata does not validate: {0}")]
    Metadata(#[from] gdr_core::metadata::MetadataError),
    /// The metadata records a pod assignment.
    #[error("its metadata records backend {0}, not vm")]
    NotVm(Backend),
    /// `CI_SPIFFE_ID` and the metadata disagree.
    #[error("{SPIFFE_ID_ENV} {env:?} disagrees with the metadata's {metadata:?}")]
    Mismatch {
        /// The ID in the task environment.
        env: String,
        /// The ID the metadata derives.
        metadata: String,
    },
    /// The sandbox's Pool hands its Pods to the next sandbox after this one (its
    /// `recycleStrategy` is not `Delete`): the next job would run in this job's VM.
    #[error(
        "its Pool {pool} recycles Pods (recycleStrategy {strategy}), so the next sandbox would run in this one's VM; set the Pool's spec.recycleStrategy.type to Delete"
    )]
    RecyclingPool {
        /// The Pool (`spec.poolRef`).
        pool: String,
        /// Its `spec.recycleStrategy.type` as found.
        strategy: String,
    },
    /// The sandbox names a Pool that does not exist (or no valid name), so whether its Pods
    /// are ever reused cannot be known.
    #[error("its Pool {pool:?} does not exist, so whether it reuses Pods cannot be known")]
    NoPool {
        /// The Pool (`spec.poolRef`) as found.
        pool: String,
    },
}

/// The recycle strategy of a Pool under which a Pod serves one sandbox only (the CRD's
/// default).
pub const DELETE_STRATEGY: &str = "Delete";

/// The Pool a sandbox's Pods come from (`spec.poolRef`); `None` for a sandbox of its own
/// template, whose Pods the pool controller never hands on. A `poolRef` that is present but
/// not a Pool name is returned as it is, and [`pool_refusal`] refuses it.
pub fn pool_ref(sandbox: &Value) -> Option<String> {
    match &sandbox["spec"]["poolRef"] {
        Value::Null => None,
        Value::String(name) => Some(name.clone()),
        other => Some(other.to_string()),
    }
}

/// Why the Pods of a sandbox of the Pool `name` (`pool`: the Pool as read, `None` when it
/// does not exist) get no identity: the brand-new environment of every job (DESIGN: a job's
/// environment is destroyed afterwards) holds for VMs only while the Pool deletes each Pod
/// its sandbox releases. `Restart` keeps the VM and restarts its containers, `Noop` keeps
/// it as it is; an unknown strategy is refused too (fail closed). A missing
/// `recycleStrategy` is the CRD's default, `Delete`.
pub fn pool_refusal(name: &str, pool: Option<&Value>) -> Option<Refusal> {
    let Some(pool) = pool.filter(|_| is_pool_name(name)) else {
        return Some(Refusal::NoPool {
            pool: name.to_owned(),
        });
    };
    let strategy = match &pool["spec"]["recycleStrategy"]["type"] {
        Value::Null => return None,
        Value::String(s) if s == DELETE_STRATEGY => return None,
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    Some(Refusal::RecyclingPool {
        pool: name.to_owned(),
        strategy,
    })
}

/// What the reconciler needs to know about entries.
#[derive(Debug, Clone)]
pub struct EntryTemplate {
    /// Trust domain of the parent and workload IDs.
    pub trust_domain: TrustDomain,
    /// The k8s_psat cluster name of the in-VM agents (`…/k8s_psat/<cluster>/pod/<uid>`).
    pub cluster: String,
    /// The spire-controller-manager class the entries belong to.
    pub class_name: String,
    /// The runner's UID inside the VM (`unix:uid:<uid>`).
    pub runner_uid: u32,
    /// The metadata codec (runner label, identity metadata, entry labels).
    pub codec: MetadataCodec,
}

/// One entry the reconciler wants to exist.
#[derive(Debug, Clone, PartialEq)]
pub struct DesiredEntry {
    /// Object name, from sandbox and Pod UID.
    pub name: String,
    /// The sandbox.
    pub sandbox: String,
    /// The Pod's UID.
    pub pod_uid: String,
    /// Labels of the object.
    pub labels: BTreeMap<String, String>,
    /// `spec` of the object.
    pub spec: Value,
}

impl EntryTemplate {
    /// The entry binding `spiffe_id` to the runner UID in the Pod `pod_uid` of `sandbox`.
    pub fn entry(&self, sandbox: &str, pod_uid: &str, spiffe_id: &str) -> DesiredEntry {
        let digest = aws_lc_rs::digest::digest(
            &aws_lc_rs::digest::SHA256,
            format!("{sandbox}/{pod_uid}").as_bytes(),
        );
        let hex: String = digest.as_ref()[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        DesiredEntry {
            name: format!("gitea-ci-{hex}"),
            sandbox: sandbox.to_owned(),
            pod_uid: pod_uid.to_owned(),
            labels: BTreeMap::from([
                (NAME_LABEL.0.to_owned(), NAME_LABEL.1.to_owned()),
                (COMPONENT_LABEL.0.to_owned(), COMPONENT_LABEL.1.to_owned()),
                (self.codec.key(SANDBOX_ID_LABEL), sandbox.to_owned()),
                (self.codec.key(POD_UID_LABEL), pod_uid.to_owned()),
            ]),
            spec: json!({
                "className": self.class_name,
                "parentID": format!(
                    "spiffe://{}/spire/agent/k8s_psat/{}/pod/{pod_uid}",
                    self.trust_domain, self.cluster
                ),
                "spiffeID": spiffe_id,
                "selectors": [format!("unix:uid:{}", self.runner_uid)],
            }),
        }
    }

    /// The SPIFFE ID `sandbox` asks for, re-validated: `CI_SPIFFE_ID` of its task, checked
    /// by shape, and, where the sandbox carries identity metadata, the identity that
    /// metadata derives (both must agree when both are present).
    pub fn spiffe_id(&self, sandbox: &Value) -> Result<String, Refusal> {
        let env = task_env(sandbox).remove(SPIFFE_ID_ENV);
        let labels = string_map(&sandbox["metadata"]["labels"]);
        let chunk_prefix = self.codec.key(keys::ANNOTATION_CHUNK);
        let from_metadata = if labels.keys().any(|k| k.starts_with(&chunk_prefix)) {
            let metadata = self.codec.unflatten(&labels)?;
            let assignment = self.codec.decode(&metadata, &self.trust_domain)?;
            if assignment.backend() != Backend::Vm {
                return Err(Refusal::NotVm(assignment.backend()));
            }
            Some(assignment.identity().spiffe_id().to_owned())
        } else {
            None
        };
        match (env, from_metadata) {
            (Some(env), Some(metadata)) if env != metadata => {
                Err(Refusal::Mismatch { env, metadata })
            }
            (_, Some(metadata)) => Ok(metadata),
            (Some(env), None) => {
                check_job_spiffe_id(&env, &self.trust_domain)?;
                Ok(env)
            }
            (None, None) => Err(Refusal::NoIdentity),
        }
    }
}

/// The Pods the sandbox holds now: those of `alloc-status` that no release annotation
/// names. A sandbox being deleted holds none; a malformed status holds none; a malformed
/// release annotation releases all.
pub fn live_pods(sandbox: &Value) -> BTreeSet<String> {
    let metadata = &sandbox["metadata"];
    if !metadata["deletionTimestamp"].is_null() {
        return BTreeSet::new();
    }
    let annotations = string_map(&metadata["annotations"]);
    let Some(mut pods) = annotations.get(ALLOC_STATUS).and_then(|a| pod_names(a)) else {
        return BTreeSet::new();
    };
    for key in ALLOC_RELEASE {
        if let Some(raw) = annotations.get(key) {
            match pod_names(raw) {
                Some(released) => pods.retain(|p| !released.contains(p)),
                None => return BTreeSet::new(),
            }
        }
    }
    pods
}

/// `pods` of an allocation annotation (`{"pods": [...], "poolRef"?, "generation"?, …}`);
/// `None` unless it is an object whose `pods` is a list of DNS names.
fn pod_names(raw: &str) -> Option<BTreeSet<String>> {
    let value: Value = serde_json::from_str(raw).ok()?;
    let pods = value.as_object()?.get("pods")?.as_array()?;
    pods.iter()
        .map(|p| {
            p.as_str()
                .filter(|n| is_dns_subdomain(n))
                .map(str::to_owned)
        })
        .collect()
}

/// Whether `name` can name a Pool (a DNS subdomain, as every object name); only such a
/// name is looked up.
pub fn is_pool_name(name: &str) -> bool {
    is_dns_subdomain(name)
}

fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        })
}

/// The task environment of a pool-mode sandbox (`spec.taskTemplate.spec.process.env`).
fn task_env(sandbox: &Value) -> BTreeMap<String, String> {
    sandbox["spec"]["taskTemplate"]["spec"]["process"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| {
            Some((
                item["name"].as_str()?.to_owned(),
                item["value"].as_str()?.to_owned(),
            ))
        })
        .collect()
}

fn string_map(value: &Value) -> BTreeMap<String, String> {
    value
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template() -> EntryTemplate {
        EntryTemplate {
            trust_domain: TrustDomain::new("example.org").unwrap(),
            cluster: "sandbox-kata".into(),
            class_name: "spire-mgmt-spire".into(),
            runner_uid: 2000,
            codec: MetadataCodec::default(),
        }
    }

    fn sandbox(annotations: Value, env_id: Option<&str>) -> Value {
        let env: Vec<Value> = env_id
            .map(|id| json!({"name": SPIFFE_ID_ENV, "value": id}))
            .into_iter()
            .collect();
        json!({
            "metadata": {"name": "sb-1", "labels": {"ci.ddupan.top/runner": "true"}, "annotations": annotations},
            "spec": {"taskTemplate": {"spec": {"process": {"env": env}}}},
        })
    }

    #[test]
    fn live_pods_are_the_allocated_ones_minus_the_released() {
        let status =
            json!({"pods": ["pool-a", "pool-b"], "poolRef": "ci-vm", "generation": 3}).to_string();
        let s = sandbox(json!({ALLOC_STATUS: status}), None);
        assert_eq!(
            live_pods(&s),
            BTreeSet::from(["pool-a".to_owned(), "pool-b".to_owned()])
        );
        let s = sandbox(
            json!({ALLOC_STATUS: status, ALLOC_RELEASE[0]: json!({"pods": ["pool-a"]}).to_string()}),
            None,
        );
        assert_eq!(live_pods(&s), BTreeSet::from(["pool-b".to_owned()]));
        let s = sandbox(
            json!({ALLOC_STATUS: status, ALLOC_RELEASE[1]: "not json"}),
            None,
        );
        assert!(
            live_pods(&s).is_empty(),
            "a malformed release releases every Pod"
        );
        for bad in [
            "not json",
            r#"{"pods": "pool-a"}"#,
            r#"{"pods": ["Not_A_Name"]}"#,
            "[]",
        ] {
            assert!(
                live_pods(&sandbox(json!({ALLOC_STATUS: bad}), None)).is_empty(),
                "{bad}"
            );
        }
        let mut deleting = sandbox(json!({ALLOC_STATUS: status}), None);
        deleting["metadata"]["deletionTimestamp"] = json!("2026-12-01T00:00:00Z");
        assert!(
            live_pods(&deleting).is_empty(),
            "a sandbox being deleted holds no Pod"
        );
    }

    /// DESIGN (a job's environment is brand-new and destroyed afterwards; issue 39 item 5's
    /// one-job rule for VMs): only a Pool that deletes every released Pod gives its
    /// sandboxes an identity; one that restarts or keeps them, an unknown strategy, a
    /// missing Pool or an invalid name are refused.
    #[test]
    fn only_a_pool_that_deletes_released_pods_lets_its_sandboxes_have_an_identity() {
        let pool =
            |strategy: Value| json!({"spec": {"capacitySpec": {}, "recycleStrategy": strategy}});
        assert_eq!(
            pool_refusal("ci-vm", Some(&json!({"spec": {}}))),
            None,
            "the CRD's default"
        );
        assert_eq!(pool_refusal("ci-vm", Some(&pool(json!({})))), None);
        assert_eq!(
            pool_refusal("ci-vm", Some(&pool(json!({"type": "Delete"})))),
            None
        );
        for (strategy, shown) in [
            (json!("Restart"), "Restart"),
            (json!("Noop"), "Noop"),
            (json!("delete"), "delete"),
            (json!(7), "7"),
        ] {
            assert_eq!(
                pool_refusal("ci-vm", Some(&pool(json!({ "type": strategy })))),
                Some(Refusal::RecyclingPool {
                    pool: "ci-vm".into(),
                    strategy: shown.into()
                }),
            );
        }
        assert_eq!(
            pool_refusal("ci-vm", None),
            Some(Refusal::NoPool {
                pool: "ci-vm".into()
            })
        );
        assert_eq!(
            pool_refusal("Not_A_Name", Some(&json!({"spec": {}}))),
            Some(Refusal::NoPool {
                pool: "Not_A_Name".into()
            }),
            "a name no Pool can have"
        );
        let of = |pool: Value| json!({"spec": {"poolRef": pool}});
        assert_eq!(pool_ref(&of(json!("ci-vm"))).as_deref(), Some("ci-vm"));
        assert_eq!(pool_ref(&of(json!(3))).as_deref(), Some("3"));
        assert_eq!(
            pool_ref(&json!({"spec": {}})),
            None,
            "a sandbox of its own template"
        );
    }

    #[test]
    fn the_entry_binds_the_exact_pod_agent_and_runner_uid() {
        let e = template().entry("sb-1", "uid-1", "spiffe://example.org/ci/o/r/build");
        assert_eq!(
            e.spec["parentID"],
            "spiffe://example.org/spire/agent/k8s_psat/sandbox-kata/pod/uid-1"
        );
        assert_eq!(e.spec["selectors"], json!(["unix:uid:2000"]));
        assert_eq!(e.spec["className"], "spire-mgmt-spire");
        assert_eq!(e.labels["ci.ddupan.top/sandbox-id"], "sb-1");
        assert_ne!(
            e.name,
            template().entry("sb-1", "uid-2", "x").name,
            "a new Pod UID is a new entry"
        );
    }

    /// DESIGN invariant 13: IDs of both schemes pass, up to the 2048 bytes a SPIFFE ID may
    /// have; another trust domain, another shape or a longer ID is refused.
    #[test]
    fn the_spiffe_id_is_revalidated() {
        let t = template();
        let longest = {
            let head = "spiffe://example.org/ci/o/r/branch/";
            let tail = "/build";
            format!("{head}{}{tail}", "b".repeat(2048 - head.len() - tail.len()))
        };
        assert_eq!(longest.len(), gdr_core::identity::MAX_SPIFFE_ID_BYTES);
        for ok in [
            "spiffe://example.org/ci/o/r/build",
            "spiffe://example.org/ci/o/r/branch/main/build",
            "spiffe://example.org/ci/o/r/pull/7/build",
            &longest,
        ] {
            assert_eq!(
                t.spiffe_id(&sandbox(json!({}), Some(ok))),
                Ok(ok.to_owned())
            );
        }
        for bad in [
            "spiffe://evil.org/ci/o/r/build",
            "spiffe://example.org/ci/o/r/heads/main/build",
            "spiffe://example.org/ci/o/r/branch/main/x/build",
            &longest.replace("/branch/b", "/branch/bb"),
        ] {
            assert!(
                matches!(
                    t.spiffe_id(&sandbox(json!({}), Some(bad))),
                    Err(Refusal::InvalidSpiffeId(_))
                ),
                "{bad}"
            );
        }
        assert_eq!(
            t.spiffe_id(&sandbox(json!({}), None)),
            Err(Refusal::NoIdentity)
        );
    }
}
