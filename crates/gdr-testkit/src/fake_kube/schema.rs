//! The real schemas of what the fake serves, so that what the code sends is checked against
//! what a real cluster admits rather than against what the fake's authors believed.
//!
//! - **Kubernetes kinds** (Pod, Secret, Lease, Node, Binding, …): the OpenAPI documents of
//!   the oldest and the newest Kubernetes release the docs claim ([`KUBERNETES_VERSIONS`]),
//!   as the `kubernetes-validate` package ships them (`v<version>-local-strict/
//!   _definitions.json`, where every object type refuses undeclared fields, as the API
//!   server does under `fieldValidation=Strict`). They are not vendored: they are found at
//!   test time ([`SCHEMA_DIR_ENV`], else the installed Python package), and a fake started
//!   where they cannot be found panics saying how to install them; nothing is skipped.
//! - **Custom resources** (ClusterStaticEntry, BatchSandbox): schemas written from the
//!   upstream CRDs (`crates/gdr-testkit/schemas/`, each naming the upstream repository,
//!   tag, commit, path and the SHA-256 of the file it was written from), checked the way
//!   the API server checks a structural CRD schema; their `metadata` is checked as the
//!   Kubernetes ObjectMeta it is.
//!
//! The validator implements exactly the keywords these documents use (`type`,
//! `properties`, `required`, `additionalProperties`, `items`, `enum`, `format`, `oneOf`,
//! `$ref`, the numeric and length bounds, `nullable`, `x-kubernetes-preserve-unknown-fields`,
//! `x-kubernetes-int-or-string`); a document using any other keyword fails to load, so a
//! newer schema can never be checked only in part without anyone noticing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use base64::Engine;
use serde_json::{Map, Value};

/// The oldest and the newest Kubernetes release the docs claim (README.md and
/// docs/pod-backend.md: "Kubernetes ≥ 1.33"; deploy/validate.sh validates the manifests
/// against the oldest; `kubernetes-validate` 1.37.0 ships schemas up to 1.37).
pub const KUBERNETES_VERSIONS: [&str; 2] = ["1.33.0", "1.37.0"];

/// Names the `kubernetes-json-schema` directory of the `kubernetes-validate` package.
pub const SCHEMA_DIR_ENV: &str = "KUBERNETES_SCHEMA_DIR";

/// How to make the schemas available, for every message that says they are missing.
const INSTALL: &str = "install them with `python3 -m pip install kubernetes-validate==1.37.0` (deploy/validate.sh does), or set KUBERNETES_SCHEMA_DIR to that package's kubernetes-json-schema directory";

/// Why a schema could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error("the Kubernetes OpenAPI schemas were not found ({why}); {INSTALL}")]
    NotFound { why: String },
    #[error("reading {path}: {source}; {INSTALL}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Parse {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("parsing the CRD schema {path}: {message}")]
    Crd { path: String, message: String },
    #[error(
        "{path} uses {keyword:?}, which the fake's schema validator does not implement: implement it before trusting this schema"
    )]
    Keyword { path: String, keyword: String },
}

/// One way an object breaks its schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// A field the schema does not declare (the server's strict decoding error).
    Unknown { path: String },
    /// A value of the wrong JSON type.
    Type {
        path: String,
        expected: String,
        found: &'static str,
    },
    /// A required field is missing.
    Required { path: String },
    /// A value outside an enum.
    NotSupported {
        path: String,
        value: String,
        supported: Vec<String>,
    },
    /// A value breaking a format or bound.
    Invalid {
        path: String,
        value: String,
        detail: String,
    },
}

impl Violation {
    /// The field path, as the API server prints it (`spec.containers[0].name`).
    pub fn path(&self) -> &str {
        match self {
            Violation::Unknown { path }
            | Violation::Type { path, .. }
            | Violation::Required { path }
            | Violation::NotSupported { path, .. }
            | Violation::Invalid { path, .. } => path,
        }
    }
}

/// A violation, and the one release whose schema reports it when the others do not (a
/// field newer than the oldest release, say).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub violation: Violation,
    pub only_in: Option<&'static str>,
}

impl Finding {
    /// ` (Kubernetes 1.33.0)` when only that release reports it, else empty.
    pub fn release(&self) -> String {
        self.only_in
            .map(|v| format!(" (Kubernetes {v})"))
            .unwrap_or_default()
    }
}

/// The definitions of one Kubernetes release.
struct Release {
    version: &'static str,
    defs: Map<String, Value>,
    /// (group, version, kind) → definition name.
    kinds: BTreeMap<(String, String, String), String>,
}

/// A custom resource's schema, written from its upstream CRD.
#[derive(Debug, Clone)]
pub struct Crd {
    pub group: String,
    pub version: String,
    pub kind: String,
    pub plural: String,
    /// `scope: Namespaced` (else `Cluster`).
    pub namespaced: bool,
    /// Whether the CRD declares the `status` subresource.
    pub status_subresource: bool,
    /// The upstream file this schema was written from.
    pub upstream: Upstream,
    schema: Value,
}

/// Where a CRD schema comes from, so anyone can re-check it against upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub repository: String,
    pub tag: String,
    pub commit: String,
    pub path: String,
    pub sha256: String,
}

/// The Kubernetes schemas the fake checks against (the CRDs are [`crds`]).
pub struct Schemas {
    releases: Vec<Release>,
}

/// The CRD schemas shipped with the test kit (file name, text).
const CRD_FILES: &[(&str, &str)] = &[
    (
        "clusterstaticentries.spire.spiffe.io.yaml",
        include_str!("../../schemas/clusterstaticentries.spire.spiffe.io.yaml"),
    ),
    (
        "batchsandboxes.sandbox.opensandbox.io.yaml",
        include_str!("../../schemas/batchsandboxes.sandbox.opensandbox.io.yaml"),
    ),
    (
        "pools.sandbox.opensandbox.io.yaml",
        include_str!("../../schemas/pools.sandbox.opensandbox.io.yaml"),
    ),
];

static SCHEMAS: OnceLock<Result<Schemas, String>> = OnceLock::new();
static CRDS: OnceLock<Vec<Crd>> = OnceLock::new();

/// The custom resources with a schema, parsed once per process. They ship with the test
/// kit, so a broken one is a bug of the kit (its unit test parses them).
#[allow(clippy::panic)]
pub fn crds() -> &'static [Crd] {
    CRDS.get_or_init(|| {
        CRD_FILES
            .iter()
            .map(|(name, text)| Crd::parse(name, text))
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("{e}"))
    })
}

/// The custom resource `group`/`plural`, if the kit has its schema.
pub fn crd(group: &str, plural: &str) -> Option<&'static Crd> {
    crds()
        .iter()
        .find(|c| c.group == group && c.plural == plural)
}

/// The schemas, loaded once per process.
pub fn schemas() -> Result<&'static Schemas, &'static str> {
    SCHEMAS
        .get_or_init(|| Schemas::load().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(String::as_str)
}

/// The `kubernetes-json-schema` directory: [`SCHEMA_DIR_ENV`], else where the installed
/// `kubernetes_validate` Python package keeps it.
pub fn schema_dir() -> Result<PathBuf, SchemaError> {
    if let Some(dir) = std::env::var_os(SCHEMA_DIR_ENV).filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import os, kubernetes_validate; print(os.path.join(os.path.dirname(kubernetes_validate.__file__), 'kubernetes-json-schema'))",
        ])
        .output()
        .map_err(|e| SchemaError::NotFound {
            why: format!("{SCHEMA_DIR_ENV} is unset and python3 could not run: {e}"),
        })?;
    if !out.status.success() {
        return Err(SchemaError::NotFound {
            why: format!(
                "{SCHEMA_DIR_ENV} is unset and python3 cannot import kubernetes_validate: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

impl Schemas {
    fn load() -> Result<Schemas, SchemaError> {
        let dir = schema_dir()?;
        let mut releases = Vec::new();
        for version in KUBERNETES_VERSIONS {
            releases.push(Release::load(&dir, version)?);
        }
        Ok(Schemas { releases })
    }

    /// The Kubernetes releases checked against.
    pub fn versions(&self) -> Vec<&'static str> {
        self.releases.iter().map(|r| r.version).collect()
    }

    /// Whether a schema exists for the kind.
    pub fn knows(&self, group: &str, version: &str, kind: &str) -> bool {
        self.crd(group, version, kind).is_some()
            || self
                .releases
                .iter()
                .all(|r| r.kind(group, version, kind).is_some())
    }

    fn crd(&self, group: &str, version: &str, kind: &str) -> Option<&'static Crd> {
        crds()
            .iter()
            .find(|c| c.group == group && c.version == version && c.kind == kind)
    }

    /// How `obj` (a create/update body of the kind) breaks the schema of each release,
    /// deduplicated; a violation only one release reports names it.
    pub fn check(&self, group: &str, version: &str, kind: &str, obj: &Value) -> Vec<Finding> {
        let mut per_release: Vec<(&'static str, Vec<Violation>)> = Vec::new();
        for r in &self.releases {
            let mut out = Vec::new();
            let ctx = Ctx { defs: &r.defs };
            if let Some(crd) = self.crd(group, version, kind) {
                ctx.check(&crd.schema, obj, "", &mut out);
                if let (Some(meta), Some(def)) = (
                    obj.get("metadata"),
                    r.defs
                        .get("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"),
                ) {
                    ctx.check(def, meta, "metadata", &mut out);
                }
            } else if let Some(def) = r.kind(group, version, kind) {
                ctx.check(def, obj, "", &mut out);
            } else {
                out.push(Violation::Invalid {
                    path: String::new(),
                    value: format!("{group}/{version} {kind}"),
                    detail: format!("Kubernetes {} has no such kind", r.version),
                });
            }
            per_release.push((r.version, out));
        }
        let mut all: Vec<Finding> = Vec::new();
        for (version, violations) in &per_release {
            for v in violations {
                if all.iter().any(|f| f.violation == *v) {
                    continue;
                }
                let everywhere = per_release.iter().all(|(_, vs)| vs.contains(v));
                all.push(Finding {
                    violation: v.clone(),
                    only_in: (!everywhere).then_some(*version),
                });
            }
        }
        all
    }
}

impl Release {
    fn load(dir: &Path, version: &'static str) -> Result<Release, SchemaError> {
        let path = dir
            .join(format!("v{version}-local-strict"))
            .join("_definitions.json");
        let text = std::fs::read_to_string(&path).map_err(|source| SchemaError::Read {
            path: path.clone(),
            source,
        })?;
        let mut doc: Value = serde_json::from_str(&text).map_err(|source| SchemaError::Parse {
            path: path.display().to_string(),
            source,
        })?;
        let Some(Value::Object(defs)) = doc.get_mut("$defs").map(Value::take) else {
            return Err(SchemaError::Crd {
                path: path.display().to_string(),
                message: "no $defs".into(),
            });
        };
        let mut kinds = BTreeMap::new();
        for (name, def) in &defs {
            check_keywords(def, &format!("{}#/$defs/{name}", path.display()))?;
            for gvk in def
                .get("x-kubernetes-group-version-kind")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let field = |f: &str| gvk[f].as_str().unwrap_or_default().to_owned();
                kinds.insert(
                    (field("group"), field("version"), field("kind")),
                    name.clone(),
                );
            }
        }
        Ok(Release {
            version,
            defs,
            kinds,
        })
    }

    fn kind(&self, group: &str, version: &str, kind: &str) -> Option<&Value> {
        let name = self
            .kinds
            .get(&(group.to_owned(), version.to_owned(), kind.to_owned()))?;
        self.defs.get(name)
    }
}

impl Crd {
    /// The `CustomResourceDefinition` (`apiextensions.k8s.io/v1`) that declares this kind
    /// with this schema, for a real API server to serve and validate it
    /// (`gdr_testkit::real_kube`).
    pub fn definition(&self) -> Value {
        let mut version = serde_json::json!({
            "name": self.version,
            "served": true,
            "storage": true,
            "schema": { "openAPIV3Schema": self.schema },
        });
        if self.status_subresource {
            version["subresources"] = serde_json::json!({ "status": {} });
        }
        serde_json::json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": { "name": format!("{}.{}", self.plural, self.group) },
            "spec": {
                "group": self.group,
                "names": {
                    "kind": self.kind,
                    "listKind": format!("{}List", self.kind),
                    "plural": self.plural,
                    "singular": self.kind.to_lowercase(),
                },
                "scope": if self.namespaced { "Namespaced" } else { "Cluster" },
                "versions": [version],
            },
        })
    }

    fn parse(name: &str, text: &str) -> Result<Crd, SchemaError> {
        let path = format!("crates/gdr-testkit/schemas/{name}");
        let doc: Value = serde_saphyr::from_str(text).map_err(|e| SchemaError::Crd {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let s = |v: &Value, f: &str| -> Result<String, SchemaError> {
            v.get(f)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| SchemaError::Crd {
                    path: path.clone(),
                    message: format!("no string {f:?}"),
                })
        };
        let upstream = &doc["upstream"];
        let schema = doc["schema"].clone();
        check_keywords(&schema, &path)?;
        Ok(Crd {
            group: s(&doc, "group")?,
            version: s(&doc, "version")?,
            kind: s(&doc, "kind")?,
            plural: s(&doc, "plural")?,
            namespaced: match s(&doc, "scope")?.as_str() {
                "Namespaced" => true,
                "Cluster" => false,
                other => {
                    return Err(SchemaError::Crd {
                        path,
                        message: format!("scope {other:?}"),
                    });
                }
            },
            status_subresource: doc["statusSubresource"] == true,
            upstream: Upstream {
                repository: s(upstream, "repository")?,
                tag: s(upstream, "tag")?,
                commit: s(upstream, "commit")?,
                path: s(upstream, "path")?,
                sha256: s(upstream, "sha256")?,
            },
            schema,
        })
    }
}

/// Keywords with a meaning the validator implements.
const KEYWORDS: &[&str] = &[
    "$ref",
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "enum",
    "format",
    "oneOf",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "nullable",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-int-or-string",
];
/// Annotations without a meaning for validation.
const ANNOTATIONS: &[&str] = &[
    "$schema",
    "$id",
    "description",
    "default",
    "x-kubernetes-group-version-kind",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-list-type",
    "x-kubernetes-map-type",
    "x-kubernetes-patch-merge-key",
    "x-kubernetes-patch-strategy",
    "x-kubernetes-unions",
];
const FORMATS: &[&str] = &["int32", "int64", "byte", "double", "float", "date-time"];

/// Refuses a schema using a keyword (or a format) the validator does not implement.
fn check_keywords(schema: &Value, path: &str) -> Result<(), SchemaError> {
    let Value::Object(m) = schema else {
        return Ok(());
    };
    let bad = |keyword: &str| SchemaError::Keyword {
        path: path.to_owned(),
        keyword: keyword.to_owned(),
    };
    for (k, v) in m {
        if !KEYWORDS.contains(&k.as_str()) && !ANNOTATIONS.contains(&k.as_str()) {
            return Err(bad(k));
        }
        if k == "format" && !v.as_str().is_some_and(|f| FORMATS.contains(&f)) {
            return Err(bad(&format!("format {v}")));
        }
    }
    if let Some(Value::Object(props)) = m.get("properties") {
        for (name, p) in props {
            check_keywords(p, &format!("{path}.{name}"))?;
        }
    }
    for k in ["items", "additionalProperties"] {
        if let Some(sub @ Value::Object(_)) = m.get(k) {
            check_keywords(sub, &format!("{path}/{k}"))?;
        }
    }
    for (i, sub) in m
        .get("oneOf")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        check_keywords(sub, &format!("{path}/oneOf/{i}"))?;
    }
    Ok(())
}

struct Ctx<'a> {
    defs: &'a Map<String, Value>,
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn type_matches(want: &str, v: &Value) -> bool {
    match want {
        "number" => v.is_number(),
        other => json_type(v) == other,
    }
}

fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_owned()
    } else {
        format!("{path}.{field}")
    }
}

fn short(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

impl Ctx<'_> {
    fn resolve<'s>(&'s self, schema: &'s Value) -> &'s Value {
        let mut s = schema;
        // `#/$defs/X` inside _definitions.json, `/api/_definitions.json#/$defs/X` from a
        // per-kind file: both name X of the same document.
        for _ in 0..64 {
            let Some(r) = s.get("$ref").and_then(Value::as_str) else {
                return s;
            };
            let name = r.rsplit_once("/$defs/").map_or(r, |(_, n)| n);
            match self.defs.get(name) {
                Some(def) => s = def,
                None => return &Value::Null,
            }
        }
        s
    }

    fn check(&self, schema: &Value, v: &Value, path: &str, out: &mut Vec<Violation>) {
        let schema = self.resolve(schema);
        let Value::Object(s) = schema else {
            return;
        };
        if v.is_null() && s.get("nullable") == Some(&Value::Bool(true)) {
            return;
        }
        if s.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
            if !matches!(json_type(v), "integer" | "string") {
                out.push(Violation::Type {
                    path: path.to_owned(),
                    expected: "integer or string".into(),
                    found: json_type(v),
                });
            }
            return;
        }
        if let Some(t) = s.get("type") {
            let wanted: Vec<&str> = match t {
                Value::String(one) => vec![one.as_str()],
                Value::Array(many) => many.iter().filter_map(Value::as_str).collect(),
                _ => Vec::new(),
            };
            if !wanted.iter().any(|w| type_matches(w, v)) {
                out.push(Violation::Type {
                    path: path.to_owned(),
                    expected: wanted.join(" or "),
                    found: json_type(v),
                });
                return;
            }
        }
        if v.is_null() {
            return;
        }
        if let Some(Value::Array(options)) = s.get("oneOf") {
            let matching = options
                .iter()
                .filter(|o| {
                    let mut sub = Vec::new();
                    self.check(o, v, path, &mut sub);
                    sub.is_empty()
                })
                .count();
            if matching != 1 {
                let expected: Vec<String> = options
                    .iter()
                    .map(|o| short(&self.resolve(o)["type"]))
                    .collect();
                out.push(Violation::Type {
                    path: path.to_owned(),
                    expected: format!("exactly one of {}", expected.join(", ")),
                    found: json_type(v),
                });
            }
        }
        if let Some(Value::Array(allowed)) = s.get("enum")
            && !allowed.contains(v)
        {
            out.push(Violation::NotSupported {
                path: path.to_owned(),
                value: short(v),
                supported: allowed.iter().map(short).collect(),
            });
        }
        self.format(s, v, path, out);
        self.bounds(s, v, path, out);
        match v {
            Value::Object(fields) => self.object(s, fields, path, out),
            Value::Array(items) => {
                if let Some(item_schema) = s.get("items") {
                    for (i, item) in items.iter().enumerate() {
                        self.check(item_schema, item, &format!("{path}[{i}]"), out);
                    }
                }
            }
            _ => {}
        }
    }

    fn object(
        &self,
        s: &Map<String, Value>,
        fields: &Map<String, Value>,
        path: &str,
        out: &mut Vec<Violation>,
    ) {
        let props = s.get("properties").and_then(Value::as_object);
        for required in s
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            // A missing field with a default is defaulted before validation.
            let defaulted = props
                .and_then(|p| p.get(required))
                .is_some_and(|p| self.resolve(p).get("default").is_some());
            if !fields.contains_key(required) && !defaulted {
                out.push(Violation::Required {
                    path: join(path, required),
                });
            }
        }
        let preserve = s.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
        for (name, value) in fields {
            let field = join(path, name);
            if let Some(p) = props.and_then(|p| p.get(name)) {
                self.check(p, value, &field, out);
                continue;
            }
            match s.get("additionalProperties") {
                Some(Value::Bool(false)) if !preserve => {
                    out.push(Violation::Unknown { path: field });
                }
                Some(extra @ Value::Object(_)) => {
                    self.check(extra, value, &format!("{path}[{name}]"), out);
                }
                // A structural CRD schema without additionalProperties declares every
                // field it keeps: the rest is unknown (pruned, or refused when strict).
                None if props.is_some() && !preserve => {
                    out.push(Violation::Unknown { path: field });
                }
                _ => {}
            }
        }
    }

    fn format(&self, s: &Map<String, Value>, v: &Value, path: &str, out: &mut Vec<Violation>) {
        let invalid = |detail: &str| Violation::Invalid {
            path: path.to_owned(),
            value: short(v),
            detail: detail.to_owned(),
        };
        match (s.get("format").and_then(Value::as_str), v) {
            (Some("int32"), Value::Number(n))
                if n.as_i64().is_none_or(|i| i32::try_from(i).is_err()) =>
            {
                out.push(invalid("must be a 32-bit integer"));
            }
            (Some("int64"), Value::Number(n)) if n.as_i64().is_none() => {
                out.push(invalid("must be a 64-bit integer"));
            }
            (Some("byte"), Value::String(text))
                if base64::engine::general_purpose::STANDARD
                    .decode(text)
                    .is_err() =>
            {
                out.push(invalid("must be base64 (standard alphabet, padded)"));
            }
            (Some("date-time"), Value::String(text))
                if text.parse::<k8s_openapi::jiff::Timestamp>().is_err() =>
            {
                out.push(invalid("must be an RFC 3339 date-time"));
            }
            _ => {}
        }
    }

    fn bounds(&self, s: &Map<String, Value>, v: &Value, path: &str, out: &mut Vec<Violation>) {
        let num = |k: &str| s.get(k).and_then(Value::as_f64);
        let len = |k: &str| s.get(k).and_then(Value::as_u64);
        let invalid = |detail: String| Violation::Invalid {
            path: path.to_owned(),
            value: short(v),
            detail,
        };
        if let Some(x) = v.as_f64() {
            if let Some(min) = num("minimum").filter(|min| x < *min) {
                out.push(invalid(format!("should be greater than or equal to {min}")));
            }
            if let Some(max) = num("maximum").filter(|max| x > *max) {
                out.push(invalid(format!("should be less than or equal to {max}")));
            }
        }
        if let Some(text) = v.as_str() {
            let n = text.chars().count() as u64;
            if let Some(min) = len("minLength").filter(|min| n < *min) {
                out.push(invalid(format!("should be at least {min} chars long")));
            }
            if let Some(max) = len("maxLength").filter(|max| n > *max) {
                out.push(invalid(format!("may not be more than {max} bytes")));
            }
        }
        if let Some(items) = v.as_array() {
            let n = items.len() as u64;
            if let Some(min) = len("minItems").filter(|min| n < *min) {
                out.push(invalid(format!("should have at least {min} items")));
            }
            if let Some(max) = len("maxItems").filter(|max| n > *max) {
                out.push(invalid(format!("must have at most {max} items")));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    fn ctx_check(schema: Value, v: Value) -> Vec<Violation> {
        let defs = Map::new();
        let mut out = Vec::new();
        Ctx { defs: &defs }.check(&schema, &v, "", &mut out);
        out
    }

    #[test]
    fn undeclared_fields_of_a_structural_schema_are_unknown_unless_preserved() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "string"}}});
        assert_eq!(
            ctx_check(schema.clone(), json!({"a": "x", "b": 1})),
            vec![Violation::Unknown { path: "b".into() }]
        );
        let mut preserved = schema;
        preserved["x-kubernetes-preserve-unknown-fields"] = json!(true);
        assert!(ctx_check(preserved, json!({"a": "x", "b": 1})).is_empty());
    }

    #[test]
    fn one_of_needs_exactly_one_match_and_formats_are_checked() {
        let int_or_string =
            json!({"oneOf": [{"type": ["string", "null"]}, {"type": ["integer", "null"]}]});
        assert!(ctx_check(int_or_string.clone(), json!(3)).is_empty());
        assert!(ctx_check(int_or_string.clone(), json!("3")).is_empty());
        assert_eq!(ctx_check(int_or_string, json!(true)).len(), 1);
        assert_eq!(
            ctx_check(
                json!({"type": "integer", "format": "int32"}),
                json!(1_i64 << 40)
            )
            .len(),
            1
        );
        assert_eq!(
            ctx_check(
                json!({"type": "string", "format": "byte"}),
                json!("not base64!")
            )
            .len(),
            1
        );
    }

    #[test]
    fn the_shipped_crd_schemas_parse_and_name_their_upstream() {
        for crd in crds() {
            assert_eq!(crd.upstream.sha256.len(), 64, "{}", crd.kind);
            assert_eq!(crd.upstream.commit.len(), 40, "{}", crd.kind);
            assert!(
                crd.upstream
                    .path
                    .ends_with(&format!("{}_{}.yaml", crd.group, crd.plural))
            );
        }
        assert!(
            !crd("spire.spiffe.io", "clusterstaticentries")
                .unwrap()
                .namespaced
        );
        assert!(
            crd("sandbox.opensandbox.io", "batchsandboxes")
                .unwrap()
                .namespaced
        );
    }

    #[test]
    fn a_schema_with_an_unimplemented_keyword_is_refused() {
        assert!(check_keywords(&json!({"type": "string", "pattern": "^a$"}), "x").is_err());
        assert!(
            check_keywords(
                &json!({"properties": {"a": {"x-kubernetes-validations": []}}}),
                "x"
            )
            .is_err()
        );
        assert!(check_keywords(&json!({"type": "string", "format": "uuid"}), "x").is_err());
        assert!(check_keywords(&json!({"type": "string", "description": "d"}), "x").is_ok());
    }
}
