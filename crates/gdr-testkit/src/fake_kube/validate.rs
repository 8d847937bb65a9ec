//! Server-side validation as the real API server does it, answered with `422 Invalid` and
//! field causes (`details.causes[] = {reason, message, field}`).
//!
//! Covered: object names (RFC 1123 subdomain, ≤ 253), label keys and values (≤ 63,
//! `[A-Za-z0-9._-]`, prefix a DNS subdomain), annotation keys, owner references, the Pod
//! spec (containers present, names RFC 1123 labels and unique, images non-empty, env
//! names, volume names and sources, mounts naming a volume, restart policy, deadline),
//! Secrets (data keys, immutability), Lease durations. Field types, enums, required fields
//! and unknown fields are the real schemas' ([`super::schema`]).
//!
//! Beyond what the API server checks, what the components behind it refuse later is refused
//! here at admission, so a test sees it at once and names the component: for a
//! ClusterStaticEntry, the SPIFFE ID and parent ID as go-spiffe parses them and the SPIRE
//! server accepts them (workload IDs outside `/spire`, parents that are agents or the server
//! of the same trust domain, k8s_psat agent IDs `…/k8s_psat/<cluster>/<Node UID>` or
//! `…/<cluster>/pod/<Pod UID>`), selectors the `k8s` and `unix` workload attestors emit
//! (`k8s:pod-uid:<UID>`, `unix:uid:<n>`, …) and a `className` (spire-controller-manager
//! ignores entries of no class); for a Pod, the SPIFFE CSI driver's `readOnly: true`.
//! Not covered: resource quantities, affinity, probes.

use serde_json::{Map, Value};

/// One field error, as `k8s.io/apimachinery/pkg/util/validation/field.Error` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cause {
    /// `FieldValueRequired`, `FieldValueInvalid`, …
    pub reason: &'static str,
    /// The error body without the field (`Required value`, `Invalid value: "x": …`).
    pub message: String,
    /// The field path (`spec.containers[0].image`).
    pub field: String,
}

impl Cause {
    fn required(field: impl Into<String>) -> Self {
        Cause {
            reason: "FieldValueRequired",
            message: "Required value".into(),
            field: field.into(),
        }
    }

    fn invalid(field: impl Into<String>, value: &str, detail: &str) -> Self {
        Cause {
            reason: "FieldValueInvalid",
            message: format!("Invalid value: {value:?}: {detail}"),
            field: field.into(),
        }
    }

    /// As [`Self::invalid`] for a number, which `field.Invalid` prints unquoted
    /// (`Invalid value: 0: …`; the real server's answer, seen in tests/real_kube.rs).
    fn invalid_number(
        field: impl Into<String>,
        value: impl std::fmt::Display,
        detail: &str,
    ) -> Self {
        Cause {
            reason: "FieldValueInvalid",
            message: format!("Invalid value: {value}: {detail}"),
            field: field.into(),
        }
    }

    fn duplicate(field: impl Into<String>, value: &str) -> Self {
        Cause {
            reason: "FieldValueDuplicate",
            message: format!("Duplicate value: {value:?}"),
            field: field.into(),
        }
    }

    fn not_found(field: impl Into<String>, value: &str) -> Self {
        Cause {
            reason: "FieldValueNotFound",
            message: format!("Not found: {value:?}"),
            field: field.into(),
        }
    }

    fn not_supported(field: impl Into<String>, value: &str, supported: &[&str]) -> Self {
        let list: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
        Cause {
            reason: "FieldValueNotSupported",
            message: format!(
                "Unsupported value: {value:?}: supported values: {}",
                list.join(", ")
            ),
            field: field.into(),
        }
    }

    pub(crate) fn forbidden(field: impl Into<String>, detail: &str) -> Self {
        Cause {
            reason: "FieldValueForbidden",
            message: format!("Forbidden: {detail}"),
            field: field.into(),
        }
    }

    /// `field: message`, as in the Status message.
    pub fn line(&self) -> String {
        format!("{}: {}", self.field, self.message)
    }
}

const DNS1123_LABEL_MAX: usize = 63;
/// The SPIFFE CSI driver's name.
pub const SPIFFE_CSI_DRIVER: &str = "csi.spiffe.io";
const DNS1123_SUBDOMAIN_MAX: usize = 253;
const LABEL_VALUE_MAX: usize = 63;
const ANNOTATIONS_MAX_BYTES: usize = 256 * 1024;
const SECRET_MAX_BYTES: usize = 1024 * 1024;

fn is_label_char(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'
}

/// An RFC 1123 label: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub fn is_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= DNS1123_LABEL_MAX
        && b.iter().all(|c| is_label_char(*c))
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// An RFC 1123 subdomain: dot-separated labels, at most 253 characters.
pub fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= DNS1123_SUBDOMAIN_MAX
        && !s.is_empty()
        && s.split('.').all(|l| {
            let b = l.as_bytes();
            !b.is_empty()
                && b.iter().all(|c| is_label_char(*c))
                && b[0] != b'-'
                && b[b.len() - 1] != b'-'
        })
}

/// A label value or the name part of a key: `(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?`.
fn is_qualified_part(s: &str) -> bool {
    let b = s.as_bytes();
    b.iter()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b.first().is_none_or(u8::is_ascii_alphanumeric)
        && b.last().is_none_or(u8::is_ascii_alphanumeric)
}

const SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const LABEL_VALUE_MSG: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')";
const QUALIFIED_NAME_MSG: &str = "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";

fn subdomain(field: &str, value: &str, out: &mut Vec<Cause>) {
    if value.len() > DNS1123_SUBDOMAIN_MAX {
        out.push(Cause::invalid(
            field,
            value,
            "must be no more than 253 characters",
        ));
    } else if !is_dns1123_subdomain(value) {
        out.push(Cause::invalid(field, value, SUBDOMAIN_MSG));
    }
}

fn dns_label(field: &str, value: &str, out: &mut Vec<Cause>) {
    if value.len() > DNS1123_LABEL_MAX {
        out.push(Cause::invalid(
            field,
            value,
            "must be no more than 63 characters",
        ));
    } else if !is_dns1123_label(value) {
        out.push(Cause::invalid(field, value, LABEL_MSG));
    }
}

/// A label or annotation key: `[prefix/]name`, prefix a DNS subdomain, name ≤ 63.
pub(crate) fn qualified_name(field: &str, key: &str, out: &mut Vec<Cause>) {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && !is_dns1123_subdomain(p)
    {
        out.push(Cause::invalid(
            field,
            key,
            &format!("prefix part {SUBDOMAIN_MSG}"),
        ));
    }
    if name.is_empty() {
        out.push(Cause::invalid(field, key, "name part must be non-empty"));
    } else if name.len() > LABEL_VALUE_MAX {
        out.push(Cause::invalid(
            field,
            key,
            "name part must be no more than 63 characters",
        ));
    } else if !is_qualified_part(name) {
        out.push(Cause::invalid(field, key, QUALIFIED_NAME_MSG));
    }
}

/// Why `v` cannot be a label value, if it cannot.
pub(crate) fn label_value_problem(v: &str) -> Option<&'static str> {
    if v.len() > LABEL_VALUE_MAX {
        Some("must be no more than 63 characters")
    } else if !is_qualified_part(v) {
        Some(LABEL_VALUE_MSG)
    } else {
        None
    }
}

fn object_meta(meta: &Map<String, Value>, out: &mut Vec<Cause>) {
    if let Some(name) = meta.get("name").and_then(Value::as_str) {
        subdomain("metadata.name", name, out);
    }
    if let Some(Value::Object(labels)) = meta.get("labels") {
        for (k, v) in labels {
            qualified_name("metadata.labels", k, out);
            let v = v.as_str().unwrap_or_default();
            if let Some(why) = label_value_problem(v) {
                out.push(Cause::invalid("metadata.labels", v, why));
            }
        }
    }
    if let Some(Value::Object(annotations)) = meta.get("annotations") {
        let mut total = 0;
        for (k, v) in annotations {
            qualified_name("metadata.annotations", k, out);
            total += k.len() + v.as_str().map_or(0, str::len);
        }
        if total > ANNOTATIONS_MAX_BYTES {
            out.push(Cause {
                reason: "FieldValueTooLong",
                message: format!("Too long: may not be more than {ANNOTATIONS_MAX_BYTES} bytes"),
                field: "metadata.annotations".into(),
            });
        }
    }
    if let Some(Value::Array(refs)) = meta.get("ownerReferences") {
        for (i, r) in refs.iter().enumerate() {
            for f in ["apiVersion", "kind", "name", "uid"] {
                if r.get(f).and_then(Value::as_str).is_none_or(str::is_empty) {
                    out.push(Cause::required(format!(
                        "metadata.ownerReferences[{i}].{f}"
                    )));
                }
            }
        }
    }
}

fn env_name_ok(s: &str) -> bool {
    // Kubernetes ≥ 1.30 relaxed env names to any printable ASCII but '='.
    !s.is_empty() && s.bytes().all(|b| (b' '..=b'~').contains(&b) && b != b'=')
}

const VOLUME_SOURCES: &[&str] = &[
    "emptyDir",
    "secret",
    "configMap",
    "projected",
    "csi",
    "hostPath",
    "persistentVolumeClaim",
    "downwardAPI",
    "ephemeral",
    "nfs",
    "image",
];

fn pod_spec(spec: Option<&Value>, out: &mut Vec<Cause>) {
    let Some(spec) = spec.and_then(Value::as_object) else {
        out.push(Cause::required("spec.containers"));
        return;
    };
    let mut volumes = Vec::new();
    if let Some(Value::Array(vs)) = spec.get("volumes") {
        for (i, v) in vs.iter().enumerate() {
            let field = format!("spec.volumes[{i}]");
            let name = v.get("name").and_then(Value::as_str).unwrap_or_default();
            if name.is_empty() {
                out.push(Cause::required(format!("{field}.name")));
            } else {
                dns_label(&format!("{field}.name"), name, out);
                if volumes.contains(&name) {
                    out.push(Cause::duplicate(format!("{field}.name"), name));
                }
                volumes.push(name);
            }
            let sources = VOLUME_SOURCES
                .iter()
                .filter(|s| v.get(**s).is_some())
                .count();
            if sources == 0 {
                out.push(Cause::required(format!(
                    "{field}: must specify a volume type"
                )));
            } else if sources > 1 {
                out.push(Cause::forbidden(
                    field.clone(),
                    "may not specify more than 1 volume type",
                ));
            }
            if let Some(csi) = v.get("csi") {
                match csi.get("driver").and_then(Value::as_str) {
                    None | Some("") => out.push(Cause::required(format!("{field}.csi.driver"))),
                    // The SPIFFE CSI driver refuses to publish a writable volume; the kubelet
                    // would keep the Pod in ContainerCreating with this message.
                    Some(SPIFFE_CSI_DRIVER) if csi.get("readOnly") != Some(&Value::Bool(true)) => {
                        out.push(Cause::invalid(
                            format!("{field}.csi.readOnly"),
                            &csi.get("readOnly").map_or("unset".to_owned(), Value::to_string),
                            "the SPIFFE CSI driver refuses it at mount time: pod.spec.volumes[].csi.readOnly must be set to 'true'",
                        ));
                    }
                    Some(_) => {}
                }
            }
            if let Some(secret) = v.get("secret")
                && secret
                    .get("secretName")
                    .and_then(Value::as_str)
                    .is_none_or(str::is_empty)
            {
                out.push(Cause::required(format!("{field}.secret.secretName")));
            }
        }
    }
    match spec.get("containers") {
        Some(Value::Array(cs)) if !cs.is_empty() => {
            let mut names = Vec::new();
            for (i, c) in cs.iter().enumerate() {
                container(
                    &format!("spec.containers[{i}]"),
                    c,
                    &volumes,
                    &mut names,
                    out,
                );
            }
        }
        _ => out.push(Cause::required("spec.containers")),
    }
    if let Some(policy) = spec.get("restartPolicy").and_then(Value::as_str) {
        let supported = ["Always", "Never", "OnFailure"];
        if !supported.contains(&policy) {
            out.push(Cause::not_supported(
                "spec.restartPolicy",
                policy,
                &supported,
            ));
        }
    }
    if let Some(d) = spec.get("activeDeadlineSeconds")
        && d.as_i64().is_none_or(|d| d < 1)
    {
        out.push(Cause::invalid_number(
            "spec.activeDeadlineSeconds",
            d,
            "must be between 1 and 2147483647, inclusive",
        ));
    }
}

fn container(
    field: &str,
    c: &Value,
    volumes: &[&str],
    names: &mut Vec<String>,
    out: &mut Vec<Cause>,
) {
    let name = c.get("name").and_then(Value::as_str).unwrap_or_default();
    if name.is_empty() {
        out.push(Cause::required(format!("{field}.name")));
    } else {
        dns_label(&format!("{field}.name"), name, out);
        if names.iter().any(|n| n == name) {
            out.push(Cause::duplicate(format!("{field}.name"), name));
        }
        names.push(name.to_owned());
    }
    let image = c.get("image").and_then(Value::as_str).unwrap_or_default();
    if image.is_empty() {
        out.push(Cause::required(format!("{field}.image")));
    } else if image.trim() != image {
        out.push(Cause::invalid(
            format!("{field}.image"),
            image,
            "must not have leading or trailing whitespace",
        ));
    }
    if let Some(Value::Array(env)) = c.get("env") {
        for (i, e) in env.iter().enumerate() {
            let f = format!("{field}.env[{i}]");
            let n = e.get("name").and_then(Value::as_str).unwrap_or_default();
            if n.is_empty() {
                out.push(Cause::required(format!("{f}.name")));
            } else if !env_name_ok(n) {
                out.push(Cause::invalid(format!("{f}.name"), n, "a valid environment variable name must consist only of printable ASCII characters other than '='"));
            }
            if e.get("value")
                .and_then(Value::as_str)
                .is_some_and(|v| !v.is_empty())
                && e.get("valueFrom").is_some()
            {
                out.push(Cause::invalid(
                    format!("{f}.valueFrom"),
                    "",
                    "may not be specified when `value` is not empty",
                ));
            }
            if let Some(r) = e.get("valueFrom").and_then(|v| v.get("secretKeyRef")) {
                for k in ["name", "key"] {
                    if r.get(k).and_then(Value::as_str).is_none_or(str::is_empty) {
                        out.push(Cause::required(format!("{f}.valueFrom.secretKeyRef.{k}")));
                    }
                }
            }
        }
    }
    if let Some(Value::Array(mounts)) = c.get("volumeMounts") {
        for (i, m) in mounts.iter().enumerate() {
            let f = format!("{field}.volumeMounts[{i}]");
            let n = m.get("name").and_then(Value::as_str).unwrap_or_default();
            if n.is_empty() {
                out.push(Cause::required(format!("{f}.name")));
            } else if !volumes.contains(&n) {
                out.push(Cause::not_found(format!("{f}.name"), n));
            }
            if m.get("mountPath")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
            {
                out.push(Cause::required(format!("{f}.mountPath")));
            }
        }
    }
}

fn secret(obj: &Map<String, Value>, out: &mut Vec<Cause>) {
    let mut total = 0;
    for field in ["data", "stringData"] {
        if let Some(Value::Object(data)) = obj.get(field) {
            for (k, v) in data {
                let ok = !k.is_empty()
                    && k.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
                if !ok {
                    out.push(Cause::invalid(format!("{field}[{k}]"), k, "a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')"));
                }
                total += v.as_str().map_or(0, str::len);
            }
        }
    }
    if total > SECRET_MAX_BYTES {
        out.push(Cause {
            reason: "FieldValueTooLong",
            message: format!("Too long: may not be more than {SECRET_MAX_BYTES} bytes"),
            field: "data".into(),
        });
    }
}

// ----- beyond the schema: what spire-controller-manager, the SPIRE server and the SPIFFE
// CSI driver refuse later, refused here at admission so a test sees it at once -------------

/// go-spiffe's `spiffeid.FromString`: `spiffe://<trust domain><path>`; the trust domain and
/// the path (empty, or `/`-separated non-empty segments).
pub fn parse_spiffe_id(id: &str) -> Result<(&str, &str), &'static str> {
    let rest = id
        .strip_prefix("spiffe://")
        .ok_or("scheme is missing or invalid")?;
    let (td, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    if td.is_empty() {
        return Err("trust domain is missing");
    }
    if !td
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_'))
    {
        return Err(
            "trust domain characters are limited to lowercase letters, numbers, dots, dashes, and underscores",
        );
    }
    if !path.is_empty() {
        let segments: Vec<&str> = path[1..].split('/').collect();
        for (i, seg) in segments.iter().enumerate() {
            if seg.is_empty() {
                return Err(if i + 1 == segments.len() {
                    "path cannot have a trailing slash"
                } else {
                    "path cannot contain empty segments"
                });
            }
            if *seg == "." || *seg == ".." {
                return Err("path cannot contain dot segments");
            }
            if !seg
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
            {
                return Err(
                    "path segment characters are limited to letters, numbers, dots, dashes, and underscores",
                );
            }
        }
    }
    Ok((td, path))
}

/// A Kubernetes UID as the API server issues it (a lowercase RFC 4122 UUID).
pub fn is_uid(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_digit() || (b'a'..=b'f').contains(c),
        })
}

/// Selector keys the `k8s` workload attestor emits (SPIRE's k8s workload attestor plugin
/// documentation); a selector it never emits matches no workload.
const K8S_SELECTORS: &[&str] = &[
    "sa",
    "ns",
    "node-name",
    "pod-uid",
    "pod-name",
    "pod-image",
    "pod-image-count",
    "pod-init-image",
    "pod-init-image-count",
    "container-image",
    "container-name",
    "pod-label",
    "pod-owner",
    "pod-owner-uid",
];
/// Selector keys the `unix` workload attestor emits.
const UNIX_SELECTORS: &[&str] = &[
    "uid",
    "user",
    "gid",
    "group",
    "supplementary_gid",
    "supplementary_group",
    "path",
    "sha256",
];

/// Why SPIRE would not take `selector` (spire-controller-manager's `parseSelector`, then
/// what the workload attestors of this deployment, `k8s` and `unix`, can ever emit).
fn selector_problem(selector: &str) -> Option<String> {
    let Some((kind, value)) = selector.split_once(':') else {
        return Some("expected at least one colon separate the type from the value".into());
    };
    if kind.is_empty() {
        return Some("type cannot be empty".into());
    }
    if value.is_empty() {
        return Some("value cannot be empty".into());
    }
    let (key, arg) = value.split_once(':').unwrap_or((value, ""));
    let known = match kind {
        "k8s" => K8S_SELECTORS,
        "unix" => UNIX_SELECTORS,
        other => {
            return Some(format!(
                "no workload attestor of this deployment (k8s, unix) emits selectors of type {other:?}"
            ));
        }
    };
    if !known.contains(&key) {
        return Some(format!(
            "the {kind} workload attestor emits no {key:?} selector (it emits {})",
            known.join(", ")
        ));
    }
    match (kind, key) {
        ("k8s", "pod-uid" | "pod-owner-uid") if !is_uid(arg) => Some(format!(
            "{kind}:{key} takes a Pod UID (a lowercase UUID), not {arg:?}"
        )),
        ("unix", "uid" | "gid" | "supplementary_gid") if arg.parse::<u32>().is_err() => {
            Some(format!("{kind}:{key} takes a number, not {arg:?}"))
        }
        _ if arg.is_empty() => Some(format!("{kind}:{key} needs a value")),
        _ => None,
    }
}

/// Why the SPIRE server would refuse `parent` as an entry's parent ID: it must be a member
/// of the server's trust domain (the entry's) with a non-empty path. An ID in the k8s_psat
/// agent namespace must moreover have the only shape such agents have,
/// `/spire/agent/k8s_psat/<cluster>/<Node UID>` (or `…/<cluster>/pod/<Pod UID>` with
/// `use_pod_uid_for_agent_id`): any other would be the parent of no agent.
fn parent_problem(parent_td: &str, path: &str, workload_td: Option<&str>) -> Option<String> {
    if let Some(td) = workload_td
        && td != parent_td
    {
        return Some(format!(
            "the SPIRE server refuses it: the parent is in trust domain {parent_td:?} but the SPIFFE ID in {td:?}, and both must be in the server's own"
        ));
    }
    if path.is_empty() {
        return Some("the SPIRE server refuses it: the path is empty".into());
    }
    if let Some(psat) = path.strip_prefix("/spire/agent/k8s_psat/") {
        let parts: Vec<&str> = psat.split('/').collect();
        let ok = match parts.as_slice() {
            [cluster, uid] | [cluster, "pod", uid] => !cluster.is_empty() && is_uid(uid),
            _ => false,
        };
        if !ok {
            return Some("no k8s_psat agent has this ID: it is /spire/agent/k8s_psat/<cluster>/<Node UID> (or …/<cluster>/pod/<Pod UID>), the UID a lowercase UUID".into());
        }
    }
    None
}

fn cluster_static_entry(obj: &Map<String, Value>, out: &mut Vec<Cause>) {
    let Some(spec) = obj.get("spec").and_then(Value::as_object) else {
        return;
    };
    const SPIRE: &str = "the SPIRE server refuses it";
    let mut workload_td = None;
    if let Some(id) = spec.get("spiffeID").and_then(Value::as_str) {
        match parse_spiffe_id(id) {
            Err(why) => out.push(Cause::invalid(
                "spec.spiffeID",
                id,
                &format!("spire-controller-manager cannot parse it: {why}"),
            )),
            Ok((_, "")) => out.push(Cause::invalid(
                "spec.spiffeID",
                id,
                &format!("{SPIRE}: not a workload, the path is empty"),
            )),
            Ok((_, path)) if path == "/spire" || path.starts_with("/spire/") => {
                out.push(Cause::invalid(
                    "spec.spiffeID",
                    id,
                    &format!("{SPIRE}: the path is in the reserved namespace /spire"),
                ));
            }
            Ok((td, _)) => workload_td = Some(td),
        }
    }
    if let Some(id) = spec.get("parentID").and_then(Value::as_str) {
        match parse_spiffe_id(id) {
            Err(why) => out.push(Cause::invalid(
                "spec.parentID",
                id,
                &format!("spire-controller-manager cannot parse it: {why}"),
            )),
            Ok((td, path)) => {
                if let Some(why) = parent_problem(td, path, workload_td) {
                    out.push(Cause::invalid("spec.parentID", id, &why));
                }
            }
        }
    }
    if let Some(Value::Array(selectors)) = spec.get("selectors") {
        if selectors.is_empty() {
            out.push(Cause::invalid(
                "spec.selectors",
                "[]",
                &format!("{SPIRE}: selector list is empty"),
            ));
        }
        for (i, s) in selectors.iter().enumerate() {
            let text = s.as_str().unwrap_or_default();
            if let Some(why) = selector_problem(text) {
                out.push(Cause::invalid(format!("spec.selectors[{i}]"), text, &why));
            }
        }
    }
    // spire-controller-manager acts only on entries of its class (or, with
    // watchClassless, on those without one); the shipped configurations set a class.
    if spec
        .get("className")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        out.push(Cause {
            reason: "FieldValueRequired",
            message: "Required value: spire-controller-manager ignores an entry without the className it is configured with".into(),
            field: "spec.className".into(),
        });
    }
}

/// The Lease spec's own validation (`ValidateLeaseSpec`).
fn lease(obj: &Map<String, Value>, out: &mut Vec<Cause>) {
    let spec = obj.get("spec");
    if let Some(d) = spec
        .and_then(|s| s.get("leaseDurationSeconds"))
        .and_then(Value::as_i64)
        && d <= 0
    {
        out.push(Cause::invalid_number(
            "spec.leaseDurationSeconds",
            d,
            "must be greater than 0",
        ));
    }
    if let Some(t) = spec
        .and_then(|s| s.get("leaseTransitions"))
        .and_then(Value::as_i64)
        && t < 0
    {
        out.push(Cause::invalid_number(
            "spec.leaseTransitions",
            t,
            "must be greater than or equal to 0",
        ));
    }
}

/// Validation errors of `obj` (a new or updated object of `plural` in `group`).
pub fn validate(group: &str, plural: &str, obj: &Map<String, Value>) -> Vec<Cause> {
    let mut out = Vec::new();
    if let Some(Value::Object(meta)) = obj.get("metadata") {
        object_meta(meta, &mut out);
    }
    match (group, plural) {
        ("", "pods") => pod_spec(obj.get("spec"), &mut out),
        ("", "secrets") => secret(obj, &mut out),
        ("coordination.k8s.io", "leases") => lease(obj, &mut out),
        ("spire.spiffe.io", "clusterstaticentries") => cluster_static_entry(obj, &mut out),
        _ => {}
    }
    out
}

/// Validation errors of an update from `old` to `new` (rules about changes), `new` as
/// stored (a Secret's `stringData` already folded into `data`).
pub fn validate_update(
    group: &str,
    plural: &str,
    old: &Value,
    new: &Map<String, Value>,
) -> Vec<Cause> {
    let mut out = Vec::new();
    // An immutable Secret's data and its immutability cannot change; its metadata can.
    if (group, plural) == ("", "secrets") && old["immutable"] == true {
        if new.get("immutable") != Some(&Value::Bool(true)) {
            out.push(Cause::forbidden(
                "immutable",
                "field is immutable when `immutable` is set",
            ));
        }
        let data = |v: Option<&Value>| v.filter(|d| !d.is_null()).cloned();
        if data(old.get("data")) != data(new.get("data")) {
            out.push(Cause::forbidden(
                "data",
                "field is immutable when `immutable` is set",
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_rfc_1123() {
        assert!(is_dns1123_subdomain("gitea-task-42"));
        assert!(is_dns1123_subdomain("a.b-c"));
        for bad in ["", "A", "-a", "a-", "a..b", "a_b", &"a".repeat(254)] {
            assert!(!is_dns1123_subdomain(bad), "{bad}");
        }
        assert!(is_dns1123_label(&"a".repeat(63)));
        assert!(!is_dns1123_label(&"a".repeat(64)));
        assert!(!is_dns1123_label("a.b"));
    }

    #[test]
    fn label_values_allow_case_dots_and_underscores_but_not_slashes() {
        for good in ["", "MyValue", "my_value", "1.2", "a-b"] {
            assert!(is_qualified_part(good), "{good}");
        }
        for bad in ["-a", "a-", "owner/repo", "a b", "spiffe://x"] {
            assert!(!is_qualified_part(bad), "{bad}");
        }
    }
}
