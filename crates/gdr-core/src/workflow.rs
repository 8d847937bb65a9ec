//! Reads the single-job workflow Gitea sends with each task (`Task.workflow_payload`).
//!
//! Gitea splits every workflow into one document per job before handing it to a runner, so
//! a payload has exactly one entry under `jobs:`. Only the job key, its display name and its
//! `runs-on` labels matter here; everything else (`on:`, steps, ...) is left to the runner.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// Largest payload we parse. Gitea's single-job payloads are a few KiB; the cap keeps a
/// hostile or corrupt task from costing more than a bounded amount of parsing.
pub const MAX_WORKFLOW_BYTES: usize = 1024 * 1024;

/// The one job of a task's workflow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SingleJob {
    /// The key under `jobs:` (stable; identity is built from it, not from the display name).
    pub key: String,
    /// The job's `name:`, if any (display only).
    pub name: Option<String>,
    /// The `runs-on` labels, flattened from any accepted form.
    pub runs_on: Vec<String>,
}

/// Why a workflow payload is not a usable single-job workflow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkflowError {
    /// The task carried no workflow at all.
    #[error("workflow payload is empty")]
    Empty,
    /// Larger than [`MAX_WORKFLOW_BYTES`].
    #[error("workflow payload is {size} bytes, more than the {max} bytes accepted")]
    TooLarge {
        /// Payload size in bytes.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// YAML text must be UTF-8.
    #[error("workflow payload is not UTF-8 (invalid byte at offset {offset})")]
    NotUtf8 {
        /// Byte offset of the first invalid sequence.
        offset: usize,
    },
    /// Not valid YAML, wrong shape (e.g. `runs-on: {}` of the wrong kind), or over the parse
    /// budget (alias bombs and the like).
    // serde-saphyr's message already ends with "at line L, column C".
    #[error("workflow YAML: {source}")]
    Yaml {
        /// What the parser objected to (built without a source snippet).
        #[source]
        source: YamlError,
        /// 1-based line, when known.
        line: Option<u64>,
        /// 1-based column, when known.
        column: Option<u64>,
    },
    /// `jobs:` is missing or empty.
    #[error("workflow has no jobs; a task's workflow must contain exactly one job")]
    NoJob,
    /// More than one job: not a payload Gitea produces for a single task.
    #[error("workflow has {count} jobs ({keys}); a task's workflow must contain exactly one job")]
    SeveralJobs {
        /// Number of jobs.
        count: usize,
        /// The job keys, comma-separated.
        keys: String,
    },
    /// `jobs.<key>` is null rather than a mapping.
    #[error("job {key:?} is empty")]
    EmptyJob {
        /// The job key.
        key: String,
    },
    /// The job has no `runs-on`, so no runner (and no backend) can be chosen.
    #[error("job {key:?} has no runs-on")]
    MissingRunsOn {
        /// The job key.
        key: String,
    },
}

/// The YAML parser's own error, kept as the cause of [`WorkflowError::Yaml`].
///
/// Shared rather than owned so that [`WorkflowError`] stays `Clone` (assignments and
/// identities carry it); two are equal when they say the same thing, which is what a
/// caller comparing outcomes means.
#[derive(Debug, Clone)]
pub struct YamlError(Arc<serde_saphyr::Error>);

impl fmt::Display for YamlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

// Transparent: this wrapper's text is the parser's, so its cause is the parser's cause.
impl std::error::Error for YamlError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl YamlError {
    /// The parser's error itself.
    pub fn parser_error(&self) -> &serde_saphyr::Error {
        &self.0
    }
}

impl PartialEq for YamlError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl Eq for YamlError {}

#[derive(Deserialize)]
struct RawWorkflow {
    // `name` and `on` are accepted and ignored; unknown keys are ignored like Gitea does.
    #[serde(default)]
    jobs: Option<BTreeMap<String, Option<RawJob>>>,
}

#[derive(Deserialize)]
struct RawJob {
    #[serde(default)]
    name: Option<String>,
    #[serde(default, rename = "runs-on")]
    runs_on: Option<RunsOn>,
}

/// `runs-on` in the forms Gitea accepts: `label`, `[a, b]`, or `{group: g, labels: a|[a, b]}`.
/// The mapping form yields the labels followed by the group, as Gitea's `Job.RunsOn()` does.
struct RunsOn(Vec<String>);

impl<'de> Deserialize<'de> for RunsOn {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(RunsOnVisitor { allow_map: true })
    }
}

/// The `labels:` of the mapping form: a string or a list, not another mapping.
struct LabelList(Vec<String>);

impl<'de> Deserialize<'de> for LabelList {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_any(RunsOnVisitor { allow_map: false })
            .map(|RunsOn(labels)| Self(labels))
    }
}

struct RunsOnVisitor {
    allow_map: bool,
}

impl<'de> Visitor<'de> for RunsOnVisitor {
    type Value = RunsOn;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.allow_map {
            f.write_str(
                "runs-on as a label, a list of labels, or a mapping with `group` and/or `labels`",
            )
        } else {
            f.write_str("labels as a label or a list of labels")
        }
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<RunsOn, E> {
        Ok(RunsOn(vec![v.to_owned()]))
    }

    // A plain scalar such as `runs-on: 1804` reaches us typed; Gitea reads it as text, so do we.
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<RunsOn, E> {
        Ok(RunsOn(vec![v.to_string()]))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<RunsOn, E> {
        Ok(RunsOn(vec![v.to_string()]))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<RunsOn, E> {
        Ok(RunsOn(vec![v.to_string()]))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RunsOn, A::Error> {
        let mut labels = Vec::new();
        while let Some(label) = seq.next_element::<String>()? {
            labels.push(label);
        }
        Ok(RunsOn(labels))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RunsOn, A::Error> {
        if !self.allow_map {
            return Err(de::Error::invalid_type(de::Unexpected::Map, &self));
        }
        let mut group: Option<String> = None;
        let mut labels: Option<Vec<String>> = None;
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "group" => group = map.next_value::<Option<String>>()?,
                "labels" => labels = map.next_value::<Option<LabelList>>()?.map(|l| l.0),
                // Gitea decodes this mapping into a struct and ignores other keys; so do we,
                // so that both sides read the same labels from the same document.
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let mut labels = labels.unwrap_or_default();
        if let Some(group) = group.filter(|g| !g.is_empty()) {
            labels.push(group);
        }
        Ok(RunsOn(labels))
    }
}

fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        // YAML 1.2 booleans: `on:` and `runs-on: on` stay strings, as in GitHub/Gitea.
        strict_booleans: true,
        // A job key or label spelled `null` or `~` is text, not a missing value.
        null_as_string: true,
        // Gitea rejects duplicate keys; accepting them could let two readers see different jobs.
        duplicate_keys: serde_saphyr::options::DuplicateKeyPolicy::Error,
        // Source snippets would copy workflow text into logs; line and column are enough.
        with_snippet: false,
        // A single job is small. These bounds turn alias bombs and deep nesting into a
        // clean error long before they cost real memory or time.
        budget: serde_saphyr::budget! {
            max_events: 200_000,
            max_aliases: 10_000,
            max_anchors: 10_000,
            max_depth: 64,
            max_nodes: 100_000,
            max_documents: 1,
            max_total_scalar_bytes: 4 * MAX_WORKFLOW_BYTES,
            max_recorded_anchor_events: 200_000,
            max_recorded_anchor_bytes: 4 * MAX_WORKFLOW_BYTES,
        },
    }
}

impl From<serde_saphyr::Error> for WorkflowError {
    fn from(err: serde_saphyr::Error) -> Self {
        let location = err.location();
        Self::Yaml {
            source: YamlError(Arc::new(err)),
            line: location.map(|l| l.line()),
            column: location.map(|l| l.column()),
        }
    }
}

/// Parses a task's workflow payload into its single job.
///
/// Never panics: every input, however malformed or large, yields `Ok` or a [`WorkflowError`].
pub fn parse_single_job(payload: &[u8]) -> Result<SingleJob, WorkflowError> {
    if payload.len() > MAX_WORKFLOW_BYTES {
        return Err(WorkflowError::TooLarge {
            size: payload.len(),
            max: MAX_WORKFLOW_BYTES,
        });
    }
    let text = std::str::from_utf8(payload).map_err(|e| WorkflowError::NotUtf8 {
        offset: e.valid_up_to(),
    })?;
    if text.trim().is_empty() {
        return Err(WorkflowError::Empty);
    }
    let raw: RawWorkflow = serde_saphyr::from_str_with_options(text, yaml_options())?;
    let mut jobs = raw.jobs.unwrap_or_default();
    if jobs.len() > 1 {
        return Err(WorkflowError::SeveralJobs {
            count: jobs.len(),
            keys: jobs
                .keys()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    let (key, job) = jobs.pop_first().ok_or(WorkflowError::NoJob)?;
    let job = job.ok_or_else(|| WorkflowError::EmptyJob { key: key.clone() })?;
    let runs_on = job
        .runs_on
        .ok_or_else(|| WorkflowError::MissingRunsOn { key: key.clone() })?;
    Ok(SingleJob {
        key,
        name: job.name,
        runs_on: runs_on.0,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn runs_on(yaml: &str) -> Result<Vec<String>, WorkflowError> {
        parse_single_job(yaml.as_bytes()).map(|job| job.runs_on)
    }

    #[test]
    fn a_single_job_yields_its_key_name_and_labels() {
        let job = parse_single_job(
            b"name: CI\non:\n  push:\njobs:\n  build:\n    name: Build it\n    runs-on: [self-hosted, pod]\n    steps: []\n",
        )
        .unwrap();
        assert_eq!(
            job,
            SingleJob {
                key: "build".into(),
                name: Some("Build it".into()),
                runs_on: vec!["self-hosted".into(), "pod".into()],
            }
        );
    }

    #[test]
    fn runs_on_is_accepted_as_string_list_and_group_mapping() {
        assert_eq!(
            runs_on("jobs:\n  a:\n    runs-on: self-hosted\n").unwrap(),
            ["self-hosted"]
        );
        assert_eq!(
            runs_on("jobs:\n  a:\n    runs-on:\n      - self-hosted\n      - vm\n").unwrap(),
            ["self-hosted", "vm"]
        );
        assert_eq!(
            runs_on("jobs:\n  a:\n    runs-on: {group: runners, labels: [self-hosted, pod]}\n")
                .unwrap(),
            ["self-hosted", "pod", "runners"]
        );
        assert_eq!(
            runs_on("jobs:\n  a:\n    runs-on:\n      group: runners\n      labels: pod\n")
                .unwrap(),
            ["pod", "runners"]
        );
        assert_eq!(
            runs_on("jobs:\n  a:\n    runs-on: {group: runners}\n").unwrap(),
            ["runners"]
        );
        assert_eq!(
            runs_on("jobs:\n  a:\n    runs-on: 1804\n").unwrap(),
            ["1804"]
        );
    }

    #[test]
    fn on_and_yaml_1_1_boolean_words_stay_strings() {
        let job = parse_single_job(
            b"on: push\njobs:\n  a:\n    name: on\n    runs-on: [self-hosted, yes, off]\n",
        )
        .unwrap();
        assert_eq!(job.name.as_deref(), Some("on"));
        assert_eq!(job.runs_on, ["self-hosted", "yes", "off"]);
    }

    #[test]
    fn null_like_job_keys_and_labels_stay_text() {
        let job = parse_single_job(b"jobs:\n  null:\n    runs-on: [self-hosted, ~]\n").unwrap();
        assert_eq!(
            (job.key.as_str(), job.runs_on),
            ("null", vec!["self-hosted".to_owned(), "~".to_owned()])
        );
    }

    #[test]
    fn zero_or_several_jobs_are_rejected_by_count() {
        assert_eq!(parse_single_job(b"name: x\n"), Err(WorkflowError::NoJob));
        assert_eq!(parse_single_job(b"jobs: {}\n"), Err(WorkflowError::NoJob));
        let err =
            parse_single_job(b"jobs:\n  a:\n    runs-on: x\n  b:\n    runs-on: y\n").unwrap_err();
        assert!(
            matches!(err, WorkflowError::SeveralJobs { count: 2, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("a, b"), "{err}");
    }

    #[test]
    fn a_job_without_runs_on_is_rejected_by_name() {
        assert_eq!(
            parse_single_job(b"jobs:\n  build:\n    steps: []\n"),
            Err(WorkflowError::MissingRunsOn {
                key: "build".into()
            })
        );
        assert_eq!(
            parse_single_job(b"jobs:\n  build:\n"),
            Err(WorkflowError::EmptyJob {
                key: "build".into()
            })
        );
    }

    #[test]
    fn a_badly_shaped_runs_on_is_a_yaml_error_with_a_position() {
        for yaml in [
            "jobs:\n  a:\n    runs-on: {labels: {x: y}}\n",
            "jobs:\n  a:\n    runs-on: [[nested]]\n",
            "jobs:\n  a:\n    runs-on: {group: [a]}\n",
        ] {
            let err = parse_single_job(yaml.as_bytes()).unwrap_err();
            let WorkflowError::Yaml { line, .. } = &err else {
                panic!("{yaml}: {err}")
            };
            assert_eq!(*line, Some(3), "{yaml}: {err}");
        }
    }

    #[test]
    fn invalid_yaml_reports_line_and_column_without_echoing_the_source() {
        let err =
            parse_single_job(b"jobs:\n  a:\n    runs-on: [self-hosted\n  secret-ish: value\n")
                .unwrap_err();
        let WorkflowError::Yaml { line, column, .. } = &err else {
            panic!("{err}")
        };
        assert!(line.is_some() && column.is_some(), "{err}");
        assert!(err.to_string().contains("line 4"), "{err}");
        assert!(!err.to_string().contains("value"), "{err}");
    }

    #[test]
    fn a_yaml_error_keeps_the_parsers_error_as_its_cause() {
        let err = parse_single_job(b"jobs:\n  a:\n    runs-on: [self-hosted\n").unwrap_err();
        let WorkflowError::Yaml { source, line, .. } = &err else {
            panic!("{err}")
        };
        let parser = source.parser_error();
        assert_eq!(parser.location().map(|l| l.line()), *line, "{err}");
        assert_eq!(err.to_string(), format!("workflow YAML: {parser}"));
        assert_eq!(err.clone(), err, "a cloned error equals its original");
    }

    #[test]
    fn duplicate_job_keys_are_rejected() {
        let err =
            parse_single_job(b"jobs:\n  a:\n    runs-on: x\n  a:\n    runs-on: y\n").unwrap_err();
        assert!(matches!(err, WorkflowError::Yaml { .. }), "{err}");
    }

    #[test]
    fn an_alias_bomb_fails_cleanly_within_the_budget() {
        let mut yaml = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..12 {
            let p = i - 1;
            yaml.push_str(&format!(
                "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
            ));
        }
        yaml.push_str("jobs:\n  a:\n    runs-on: *a11\n");
        let err = parse_single_job(yaml.as_bytes()).unwrap_err();
        assert!(matches!(err, WorkflowError::Yaml { .. }), "{err}");
    }

    #[test]
    fn oversized_empty_and_non_utf8_payloads_are_rejected_before_parsing() {
        let big = vec![b' '; MAX_WORKFLOW_BYTES + 1];
        assert!(matches!(
            parse_single_job(&big),
            Err(WorkflowError::TooLarge { .. })
        ));
        assert_eq!(parse_single_job(b"  \n"), Err(WorkflowError::Empty));
        assert_eq!(
            parse_single_job(b"jobs: \xff"),
            Err(WorkflowError::NotUtf8 { offset: 6 })
        );
    }

    #[test]
    fn several_documents_are_rejected() {
        let err =
            parse_single_job(b"jobs:\n  a:\n    runs-on: x\n---\njobs:\n  b:\n    runs-on: y\n")
                .unwrap_err();
        assert!(matches!(err, WorkflowError::Yaml { .. }), "{err}");
    }

    proptest! {
        #[test]
        fn parsing_arbitrary_text_never_panics(text in ".{0,400}") {
            let _ = parse_single_job(text.as_bytes());
        }

        #[test]
        fn parsing_yaml_like_text_never_panics(
            text in r#"(jobs:|runs-on:|  |- |\[|\]|\{|\}|&a |\*a|: |,|\n|x|'|"|#|!!str |---\n){0,60}"#
        ) {
            let _ = parse_single_job(text.as_bytes());
        }
    }
}
