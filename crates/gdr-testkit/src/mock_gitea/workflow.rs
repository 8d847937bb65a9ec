//! Splitting a workflow file into single-job payloads the way Gitea's jobparser does.
//!
//! Gitea stores one `SingleWorkflow` YAML per job (and per matrix combination) and hands it
//! to the runner as `Task.workflow_payload`. The mock reproduces the shape the runner relies
//! on: top-level `name`/`on`/`env`/…, exactly one entry under `jobs`, `runs-on` re-encoded
//! (scalar for one label, sequence otherwise) and `needs` erased.

use serde::Serialize;
use serde_json::{Map, Value};

use super::MockError;

/// One job of a parsed workflow, ready to be queued.
#[derive(Debug, Clone)]
pub(crate) struct ParsedJob {
    /// The key under `jobs:` (Gitea's job id).
    pub key: String,
    /// `name:` of the job, defaulting to the key.
    pub name: String,
    /// Labels a runner must all carry to receive the job.
    pub runs_on: Vec<String>,
    /// The single-job workflow YAML sent as `workflow_payload`.
    pub payload: String,
}

/// A parsed workflow file.
#[derive(Debug, Clone)]
pub(crate) struct ParsedWorkflow {
    /// Top-level `name:`; Gitea falls back to the file name, the mock to "workflow".
    pub name: String,
    pub jobs: Vec<ParsedJob>,
}

/// Field order of Gitea's `SingleWorkflow` (jobparser/model.go), so payloads read like
/// Gitea's. `Option` fields that are absent are left out rather than written as `null`.
#[derive(Serialize)]
struct SingleWorkflow<'a> {
    name: &'a str,
    #[serde(rename = "on", skip_serializing_if = "Option::is_none")]
    on: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    env: Option<&'a Value>,
    jobs: Map<String, Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    defaults: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    permissions: Option<&'a Value>,
    #[serde(rename = "run-name", skip_serializing_if = "Option::is_none")]
    run_name: Option<&'a Value>,
}

fn invalid(msg: impl Into<String>) -> MockError {
    MockError::InvalidWorkflow(msg.into())
}

/// Parses `yaml` and produces one [`ParsedJob`] per key under `jobs:`.
pub(crate) fn parse_workflow(yaml: &str) -> Result<ParsedWorkflow, MockError> {
    // YAML 1.2 booleans: an unquoted `on:` key must stay the string "on".
    let options = serde_saphyr::options! { strict_booleans: true };
    let doc: Value = serde_saphyr::from_str_with_options(yaml, options)
        .map_err(|e| invalid(format!("not valid YAML: {e}")))?;
    let Value::Object(top) = doc else {
        return Err(invalid("the workflow must be a mapping"));
    };
    let name = match top.get("name") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => scalar_to_string(other).ok_or_else(|| invalid("`name` must be a string"))?,
        None => "workflow".to_owned(),
    };
    let Some(Value::Object(jobs)) = top.get("jobs") else {
        return Err(invalid("the workflow has no `jobs` mapping"));
    };
    if jobs.is_empty() {
        return Err(invalid("`jobs` is empty"));
    }

    let mut parsed = Vec::with_capacity(jobs.len());
    for (key, job) in jobs {
        let Value::Object(job) = job else {
            return Err(invalid(format!("job `{key}` must be a mapping")));
        };
        if job
            .get("strategy")
            .and_then(|s| s.get("matrix"))
            .is_some_and(|m| !m.is_null())
        {
            // Expanding a matrix needs expression evaluation; the mock does not pretend to.
            return Err(MockError::Unsupported(format!(
                "job `{key}` uses strategy.matrix, which the mock Gitea does not support"
            )));
        }
        let runs_on = match job.get("runs-on") {
            None | Some(Value::Null) => Vec::new(),
            Some(v) => parse_runs_on(v).map_err(|e| invalid(format!("job `{key}`: {e}")))?,
        };
        let job_name = match job.get("name") {
            Some(v) => scalar_to_string(v).unwrap_or_else(|| key.clone()),
            None => key.clone(),
        };

        let mut out_job = job.clone();
        // Gitea erases `needs` before storing the payload; the runner rebuilds it from
        // `Task.needs`.
        out_job.remove("needs");
        out_job.insert("name".to_owned(), Value::String(job_name.clone()));
        match runs_on.as_slice() {
            [] => {
                out_job.remove("runs-on");
            }
            [one] => {
                out_job.insert("runs-on".to_owned(), Value::String(one.clone()));
            }
            many => {
                out_job.insert(
                    "runs-on".to_owned(),
                    Value::Array(many.iter().cloned().map(Value::String).collect()),
                );
            }
        }
        let mut single_jobs = Map::new();
        single_jobs.insert(key.clone(), Value::Object(out_job));
        let single = SingleWorkflow {
            name: &name,
            on: top.get("on"),
            env: top.get("env"),
            jobs: single_jobs,
            defaults: top.get("defaults"),
            permissions: top.get("permissions"),
            run_name: top.get("run-name"),
        };
        let payload = serde_saphyr::to_string(&single)
            .map_err(|e| invalid(format!("cannot re-encode job `{key}`: {e}")))?;
        parsed.push(ParsedJob {
            key: key.clone(),
            name: job_name,
            runs_on,
            payload,
        });
    }
    Ok(ParsedWorkflow { name, jobs: parsed })
}

/// `runs-on` as a string, a list of strings, or `{group, labels}` (labels + [group]).
fn parse_runs_on(v: &Value) -> Result<Vec<String>, String> {
    match v {
        Value::Array(items) => items
            .iter()
            .map(|i| {
                scalar_to_string(i).ok_or_else(|| "runs-on entries must be strings".to_owned())
            })
            .collect(),
        Value::Object(map) => {
            let mut labels = match map.get("labels") {
                None | Some(Value::Null) => Vec::new(),
                Some(l) => parse_runs_on(l)?,
            };
            if let Some(group) = map.get("group") {
                labels.push(
                    scalar_to_string(group)
                        .ok_or_else(|| "runs-on.group must be a string".to_owned())?,
                );
            }
            Ok(labels)
        }
        other => scalar_to_string(other)
            .map(|s| vec![s])
            .ok_or_else(|| "runs-on must be a string, a list or {group, labels}".to_owned()),
    }
}

fn scalar_to_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_payload_per_job_with_runs_on_re_encoded_and_needs_erased() {
        let yaml = r#"
name: ci
on: push
jobs:
  build:
    runs-on: [self-hosted, pod]
    steps:
      - run: echo hi
  test:
    needs: build
    runs-on:
      group: big
      labels: linux
    steps:
      - run: echo test
"#;
        let wf = parse_workflow(yaml).unwrap();
        assert_eq!(wf.name, "ci");
        assert_eq!(wf.jobs.len(), 2);
        let build = &wf.jobs[0];
        assert_eq!(build.runs_on, vec!["self-hosted", "pod"]);
        let v: Value = serde_saphyr::from_str(&build.payload).unwrap();
        assert_eq!(v["on"], "push");
        assert_eq!(v["jobs"]["build"]["name"], "build");
        assert!(v["jobs"]["build"]["runs-on"].is_array());
        let test = &wf.jobs[1];
        assert_eq!(test.runs_on, vec!["linux", "big"]);
        let v: Value = serde_saphyr::from_str(&test.payload).unwrap();
        assert!(v["jobs"]["test"].get("needs").is_none());
        assert_eq!(
            v["jobs"]["test"]["runs-on"],
            serde_json::json!(["linux", "big"])
        );
        assert_eq!(v["jobs"].as_object().unwrap().len(), 1);
    }

    #[test]
    fn a_single_label_is_a_scalar_and_matrix_is_rejected() {
        let wf = parse_workflow("on: push\njobs:\n  a:\n    runs-on: [x]\n").unwrap();
        let v: Value = serde_saphyr::from_str(&wf.jobs[0].payload).unwrap();
        assert_eq!(v["jobs"]["a"]["runs-on"], "x");
        // serde-saphyr quotes the key so YAML 1.1 readers cannot turn it into `true`.
        assert!(
            wf.jobs[0].payload.contains("\"on\": push"),
            "{}",
            wf.jobs[0].payload
        );
        let err = parse_workflow(
            "on: push\njobs:\n  a:\n    runs-on: x\n    strategy:\n      matrix:\n        v: [1, 2]\n",
        )
        .unwrap_err();
        assert!(matches!(err, MockError::Unsupported(_)), "{err}");
    }
}
