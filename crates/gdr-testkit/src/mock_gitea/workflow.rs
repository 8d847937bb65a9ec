//! Splitting a workflow file into single-job payloads the way Gitea's jobparser does.
//!
//! Gitea stores one `SingleWorkflow` YAML per job (and per matrix combination) and hands it
//! to the runner as `Task.workflow_payload`. The mock reproduces the shape the runner relies
//! on: top-level `name`/`on`/`env`/…, exactly one entry under `jobs`, `runs-on` re-encoded
//! (scalar for one label, sequence otherwise) and `needs` erased.
//!
//! A `strategy.matrix` of plain lists becomes one job per combination, as jobparser expands
//! it: the same job key, the name followed by the combination's values in key order
//! (`build (1, a)`), and the payload's matrix narrowed to that combination. `include`,
//! `exclude` and expressions need evaluation the mock does not pretend to do.

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
        let combinations = match job.get("strategy").and_then(|s| s.get("matrix")) {
            None | Some(Value::Null) => vec![Map::new()],
            Some(matrix) => expand_matrix(key, matrix)?,
        };
        let runs_on = match job.get("runs-on") {
            None | Some(Value::Null) => Vec::new(),
            Some(v) => parse_runs_on(v).map_err(|e| invalid(format!("job `{key}`: {e}")))?,
        };
        let base_name = match job.get("name") {
            Some(v) => scalar_to_string(v).unwrap_or_else(|| key.clone()),
            None => key.clone(),
        };
        for combination in combinations {
            let job_name = if combination.is_empty() {
                base_name.clone()
            } else {
                let values: Vec<String> = combination
                    .values()
                    .map(|v| scalar_to_string(v).unwrap_or_default())
                    .collect();
                format!("{base_name} ({})", values.join(", "))
            };
            let mut out_job = job.clone();
            if !combination.is_empty() {
                let narrowed: Map<String, Value> = combination
                    .into_iter()
                    .map(|(k, v)| (k, Value::Array(vec![v])))
                    .collect();
                let mut strategy = match job.get("strategy") {
                    Some(Value::Object(s)) => s.clone(),
                    _ => Map::new(),
                };
                strategy.insert("matrix".to_owned(), Value::Object(narrowed));
                out_job.insert("strategy".to_owned(), Value::Object(strategy));
            }
            parsed.push(single_job(&top, &name, key, job_name, &runs_on, out_job)?);
        }
    }
    Ok(ParsedWorkflow { name, jobs: parsed })
}

/// The combinations of a matrix of plain lists, each a mapping from matrix key to value
/// (keys in order, as jobparser names them).
fn expand_matrix(key: &str, matrix: &Value) -> Result<Vec<Map<String, Value>>, MockError> {
    let unsupported = |what: &str| {
        MockError::Unsupported(format!(
            "job `{key}`: strategy.matrix {what} is not supported by the mock Gitea"
        ))
    };
    let Value::Object(axes) = matrix else {
        return Err(unsupported("that is not a mapping"));
    };
    let mut combinations = vec![Map::new()];
    for (axis, values) in axes {
        if axis == "include" || axis == "exclude" {
            return Err(unsupported(&format!("`{axis}`")));
        }
        let Value::Array(values) = values else {
            return Err(unsupported(&format!("`{axis}` that is not a list")));
        };
        if values.iter().any(|v| scalar_to_string(v).is_none()) {
            return Err(unsupported(&format!("`{axis}` with non-scalar values")));
        }
        combinations = combinations
            .into_iter()
            .flat_map(|c| {
                values.iter().map(move |v| {
                    let mut c = c.clone();
                    c.insert(axis.clone(), v.clone());
                    c
                })
            })
            .collect();
    }
    if combinations.iter().all(Map::is_empty) {
        return Err(unsupported("without values"));
    }
    Ok(combinations)
}

/// One job's single-job workflow.
fn single_job(
    top: &Map<String, Value>,
    name: &str,
    key: &str,
    job_name: String,
    runs_on: &[String],
    mut out_job: Map<String, Value>,
) -> Result<ParsedJob, MockError> {
    // Gitea erases `needs` before storing the payload; the runner rebuilds it from
    // `Task.needs`.
    out_job.remove("needs");
    out_job.insert("name".to_owned(), Value::String(job_name.clone()));
    match runs_on {
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
    single_jobs.insert(key.to_owned(), Value::Object(out_job));
    let single = SingleWorkflow {
        name,
        on: top.get("on"),
        env: top.get("env"),
        jobs: single_jobs,
        defaults: top.get("defaults"),
        permissions: top.get("permissions"),
        run_name: top.get("run-name"),
    };
    let payload = serde_saphyr::to_string(&single)
        .map_err(|e| invalid(format!("cannot re-encode job `{key}`: {e}")))?;
    Ok(ParsedJob {
        key: key.to_owned(),
        name: job_name,
        runs_on: runs_on.to_vec(),
        payload,
    })
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
    fn a_matrix_of_lists_becomes_one_job_per_combination_with_the_same_key() {
        let wf = parse_workflow(
            "on: push\njobs:\n  build:\n    runs-on: x\n    strategy:\n      fail-fast: false\n      matrix:\n        os: [a, b]\n        v: [1, 2, 3]\n    steps:\n      - run: echo ${{ matrix.v }}\n",
        )
        .unwrap();
        assert_eq!(wf.jobs.len(), 6);
        assert!(wf.jobs.iter().all(|j| j.key == "build"));
        let names: Vec<&str> = wf.jobs.iter().map(|j| j.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "build (a, 1)",
                "build (a, 2)",
                "build (a, 3)",
                "build (b, 1)",
                "build (b, 2)",
                "build (b, 3)"
            ]
        );
        let v: Value = serde_saphyr::from_str(&wf.jobs[4].payload).unwrap();
        let strategy = &v["jobs"]["build"]["strategy"];
        assert_eq!(
            strategy["matrix"],
            serde_json::json!({"os": ["b"], "v": [2]})
        );
        assert_eq!(strategy["fail-fast"], false);
        for unsupported in [
            "matrix:\n        include: [{v: 1}]",
            "matrix:\n        v: ${{ fromJSON('[1]') }}",
            "matrix:\n        v: []",
        ] {
            let err = parse_workflow(&format!(
                "on: push\njobs:\n  a:\n    runs-on: x\n    strategy:\n      {unsupported}\n"
            ))
            .unwrap_err();
            assert!(
                matches!(err, MockError::Unsupported(_)),
                "{unsupported}: {err}"
            );
        }
    }

    #[test]
    fn a_single_label_is_a_scalar() {
        let wf = parse_workflow("on: push\njobs:\n  a:\n    runs-on: [x]\n").unwrap();
        let v: Value = serde_saphyr::from_str(&wf.jobs[0].payload).unwrap();
        assert_eq!(v["jobs"]["a"]["runs-on"], "x");
        // serde-saphyr quotes the key so YAML 1.1 readers cannot turn it into `true`.
        assert!(
            wf.jobs[0].payload.contains("\"on\": push"),
            "{}",
            wf.jobs[0].payload
        );
    }
}
