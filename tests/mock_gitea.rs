//! The mock Gitea, exercised over real HTTP with the generated Connect client: one test per
//! rule of `reference/gitea-protocol.md` §3 that the mock reproduces.
//!
//! These tests protect no product invariant: they keep the test peer faithful to the real
//! Gitea, so that every controller test run against it means what it says. `Peer fidelity`
//! lines state the Gitea behaviour pinned: the tasks version and the job pick, label
//! matching, the task's payload and context, who may update a task, results and
//! cancellation, log ack indexes and archiving, outputs, the zombie sweep, ephemeral runners,
//! registration, errors as they appear on the wire, compression. `Peer harness` lines pin the
//! mock's own test controls (fault injection, admin API, blob endpoint, waiting, shutdown).

use std::collections::HashSet;
use std::time::Duration;

use connectrpc::client::{CallOptions, ClientConfig, HttpClient};
use connectrpc::{ConnectError, ErrorCode};
use gdr_proto::ping::v1 as ping;
use gdr_proto::runner::v1 as pb;
use gdr_testkit::mock_gitea::{
    GrpcCode, JobId, MockConfig, MockFault, MockGitea, RpcMethod, RunningMock, Status, Trigger,
};

type Client = pb::RunnerServiceClient<HttpClient>;

const WAIT: Duration = Duration::from_secs(10);

const ONE_JOB: &str = r#"
name: ci
on: push
jobs:
  build:
    runs-on: [self-hosted, pod]
    steps:
      - run: echo hi
"#;

async fn start() -> RunningMock {
    start_with(MockConfig::default()).await
}

async fn start_with(config: MockConfig) -> RunningMock {
    MockGitea::start(config).await.unwrap()
}

fn config(mock: &RunningMock) -> ClientConfig {
    ClientConfig::new(mock.api_url().parse().unwrap())
}

fn anonymous(mock: &RunningMock) -> Client {
    pb::RunnerServiceClient::new(HttpClient::plaintext(), config(mock))
}

fn authed(mock: &RunningMock, uuid: &str, token: &str) -> Client {
    let cfg = config(mock)
        .with_default_header("x-runner-uuid", uuid)
        .with_default_header("x-runner-token", token);
    pb::RunnerServiceClient::new(HttpClient::plaintext(), cfg)
}

/// A runner created behind the API's back, with its client.
fn runner(mock: &RunningMock, labels: &[&str], ephemeral: bool) -> (Client, String) {
    let (uuid, token) = mock.handle.create_runner("r", labels, ephemeral);
    (authed(mock, &uuid, &token), uuid)
}

async fn fetch(c: &Client, version: i64) -> Result<pb::FetchTaskResponse, ConnectError> {
    Ok(c.fetch_task(pb::FetchTaskRequest {
        tasks_version: version,
        ..Default::default()
    })
    .await?
    .into_owned())
}

async fn fetch_task(c: &Client) -> pb::Task {
    fetch(c, 0)
        .await
        .unwrap()
        .task
        .into_option()
        .expect("a task")
}

fn state(task_id: i64, result: pb::TaskResult) -> pb::TaskState {
    pb::TaskState {
        id: task_id,
        result: result.into(),
        ..Default::default()
    }
}

async fn update(
    c: &Client,
    task_state: pb::TaskState,
    outputs: &[(&str, &str)],
) -> Result<pb::UpdateTaskResponse, ConnectError> {
    Ok(c.update_task(pb::UpdateTaskRequest {
        state: buffa::MessageField::some(task_state),
        outputs: outputs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    })
    .await?
    .into_owned())
}

async fn heartbeat(c: &Client, task_id: i64) -> pb::UpdateTaskResponse {
    update(c, state(task_id, pb::TaskResult::RESULT_UNSPECIFIED), &[])
        .await
        .unwrap()
}

async fn log(
    c: &Client,
    task_id: i64,
    index: i64,
    rows: &[&str],
    no_more: bool,
) -> Result<i64, ConnectError> {
    let rows = rows
        .iter()
        .map(|r| pb::LogRow {
            content: (*r).to_owned(),
            ..Default::default()
        })
        .collect();
    Ok(c.update_log(pb::UpdateLogRequest {
        task_id,
        index,
        rows,
        no_more,
        ..Default::default()
    })
    .await?
    .into_owned()
    .ack_index)
}

fn result_of(resp: &pb::UpdateTaskResponse) -> i32 {
    resp.state.as_option().map_or(-1, |s| s.result.to_i32())
}

fn assert_gitea_error(err: &ConnectError, code: &str, desc: &str) {
    assert_eq!(err.code, ErrorCode::Unknown, "{err:?}");
    assert_eq!(
        err.message.as_deref(),
        Some(format!("rpc error: code = {code} desc = {desc}").as_str())
    );
}

fn job_with_script(key: &str, labels: &str, script: &str) -> String {
    format!("on: push\njobs:\n  {key}:\n    runs-on: {labels}\n    steps:\n      - run: {script}\n")
}

/// Peer fidelity: as in Gitea, a FetchTask sending the latest tasks version skips the job pick
/// (no task), and version 0 makes Gitea pick.
#[tokio::test]
async fn fetching_with_the_latest_version_skips_the_job_pick() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    mock.handle.queue_workflow("o/r", ONE_JOB).unwrap();
    let latest = mock.handle.tasks_version();

    let resp = fetch(&c, latest).await.unwrap();
    assert!(resp.task.is_unset(), "an up-to-date runner gets no task");
    assert_eq!(resp.tasks_version, latest);

    let resp = fetch(&c, 0).await.unwrap();
    assert!(resp.task.is_set(), "version 0 makes Gitea pick");
}

/// Peer fidelity: Gitea's tasks version starts at 1, so a runner's 0 always differs from it.
#[tokio::test]
async fn the_tasks_version_starts_at_one() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["x"], false);
    let resp = fetch(&c, 0).await.unwrap();
    assert_eq!(resp.tasks_version, 1);
    assert!(resp.task.is_unset());
}

/// Peer fidelity: claiming a job does not bump Gitea's tasks version (the reason the scheduler
/// resets its shared version to 0 after every task).
#[tokio::test]
async fn claiming_a_job_does_not_bump_the_tasks_version() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    mock.handle.queue_workflow("o/r", ONE_JOB).unwrap();
    let before = mock.handle.tasks_version();
    let resp = fetch(&c, 0).await.unwrap();
    assert!(resp.task.is_set());
    assert_eq!(resp.tasks_version, before);
    assert_eq!(mock.handle.tasks_version(), before);
}

/// Peer fidelity: queueing a job bumps Gitea's tasks version, so a runner with the old version
/// picks the new job.
#[tokio::test]
async fn queueing_a_job_bumps_the_tasks_version() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    let before = fetch(&c, 0).await.unwrap().tasks_version;
    mock.handle.queue_workflow("o/r", ONE_JOB).unwrap();
    let after = mock.handle.tasks_version();
    assert!(after > before, "{after} > {before}");
    // The runner's cached (old) version now differs, so it picks the new job.
    let resp = fetch(&c, before).await.unwrap();
    assert!(resp.task.is_set());
    assert_eq!(resp.tasks_version, after);
}

/// Peer fidelity: concurrent fetches of one runner claim distinct jobs, each once, as Gitea's
/// transactional pick does.
#[tokio::test]
async fn concurrent_fetches_claim_distinct_jobs() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["l"], false);
    let mut yaml = String::from("on: push\njobs:\n");
    for i in 0..5 {
        yaml.push_str(&format!(
            "  j{i}:\n    runs-on: l\n    steps:\n      - run: echo {i}\n"
        ));
    }
    let jobs = mock.handle.queue_workflow("o/r", &yaml).unwrap();
    assert_eq!(jobs.len(), 5);

    let fetches = (0..8).map(|_| fetch(&c, 0));
    let results = futures::future::join_all(fetches).await;
    let tasks: Vec<pb::Task> = results
        .into_iter()
        .filter_map(|r| r.unwrap().task.into_option())
        .collect();
    assert_eq!(
        tasks.len(),
        5,
        "five jobs, five claims, three empty answers"
    );
    let ids: HashSet<i64> = tasks.iter().map(|t| t.id).collect();
    assert_eq!(ids.len(), 5);
    let claimed: HashSet<JobId> = ids
        .iter()
        .map(|id| mock.handle.task(*id).unwrap().job_id)
        .collect();
    assert_eq!(claimed, jobs.into_iter().collect());
}

/// Peer fidelity: Gitea offers the oldest waiting job first.
#[tokio::test]
async fn the_oldest_waiting_job_is_offered_first() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["l"], false);
    let first = mock
        .handle
        .queue_workflow("o/r", &job_with_script("a", "l", "1"))
        .unwrap()[0];
    mock.handle
        .queue_workflow("o/r", &job_with_script("b", "l", "2"))
        .unwrap();
    let task = fetch_task(&c).await;
    assert_eq!(mock.handle.task(task.id).unwrap().job_id, first);
}

/// Peer fidelity: Gitea offers a job only to runners whose labels cover its `runs-on`; `{group,
/// labels}` needs the labels and the group.
#[tokio::test]
async fn a_job_is_only_offered_to_runners_whose_labels_cover_its_runs_on() {
    let mock = start().await;
    let (narrow, _) = runner(&mock, &["self-hosted"], false);
    let (wide, _) = runner(&mock, &["self-hosted", "pod", "extra"], false);
    let job = mock.handle.queue_workflow("o/r", ONE_JOB).unwrap()[0];

    assert!(fetch(&narrow, 0).await.unwrap().task.is_unset());
    let task = fetch_task(&wide).await;
    assert_eq!(mock.handle.job(job).unwrap().task_id, Some(task.id));

    // `{group, labels}` needs labels + [group].
    let grouped = "on: push\njobs:\n  g:\n    runs-on:\n      group: big\n      labels: [pod]\n";
    let g = mock.handle.queue_workflow("o/r", grouped).unwrap()[0];
    assert_eq!(mock.handle.job(g).unwrap().runs_on, vec!["pod", "big"]);
    assert!(fetch(&wide, 0).await.unwrap().task.is_unset());
    let (big, _) = runner(&mock, &["pod", "big"], false);
    assert!(fetch(&big, 0).await.unwrap().task.is_set());
}

/// Peer fidelity: a job without `runs-on` goes to any runner, as in Gitea.
#[tokio::test]
async fn a_job_without_runs_on_goes_to_any_runner() {
    let mock = start().await;
    let (c, _) = runner(&mock, &[], false);
    mock.handle
        .queue_workflow("o/r", "on: push\njobs:\n  a:\n    steps:\n      - run: x\n")
        .unwrap();
    assert!(fetch(&c, 0).await.unwrap().task.is_set());
}

/// Peer fidelity: a disabled runner gets no task, and enabling it bumps the tasks version, as
/// in Gitea.
#[tokio::test]
async fn disabled_runners_get_no_task() {
    let mock = start().await;
    let (c, uuid) = runner(&mock, &["self-hosted", "pod"], false);
    mock.handle.queue_workflow("o/r", ONE_JOB).unwrap();
    assert!(mock.handle.set_runner_disabled(&uuid, true));
    assert!(fetch(&c, 0).await.unwrap().task.is_unset());
    let before = mock.handle.tasks_version();
    assert!(mock.handle.set_runner_disabled(&uuid, false));
    assert!(
        mock.handle.tasks_version() > before,
        "enabling bumps the version"
    );
    assert!(fetch(&c, 0).await.unwrap().task.is_set());
}

/// Peer fidelity: a task carries Gitea's single-job workflow payload (`needs` erased, one label
/// as a scalar), the `github` context, the job token as `GITHUB_TOKEN` and `GITEA_TOKEN`, the
/// repository's secrets and variables; task IDs are never reused.
#[tokio::test]
async fn the_task_carries_a_single_job_payload_context_secrets_and_vars() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    mock.handle.set_secret("octo/app", "DEPLOY_KEY", "s3cret");
    mock.handle.set_variable("octo/app", "REGION", "eu");
    let yaml = r#"
name: pipeline
on: push
jobs:
  first:
    runs-on: pod
    steps:
      - run: echo 1
  second:
    needs: first
    runs-on: [self-hosted, pod]
    steps:
      - run: echo 2
"#;
    let jobs = mock.handle.queue_workflow("octo/app", yaml).unwrap();
    let t1 = fetch_task(&c).await;
    let t2 = fetch_task(&c).await;
    assert_ne!(t1.id, t2.id, "task ids are never reused");

    let payload: serde_json::Value =
        serde_saphyr::from_slice(t2.workflow_payload.as_deref().unwrap()).unwrap();
    assert_eq!(payload["name"], "pipeline");
    assert_eq!(payload["on"], "push");
    let jobs_map = payload["jobs"].as_object().unwrap();
    assert_eq!(jobs_map.len(), 1);
    assert!(jobs_map["second"].get("needs").is_none(), "needs is erased");
    assert_eq!(
        jobs_map["second"]["runs-on"],
        serde_json::json!(["self-hosted", "pod"])
    );
    let p1: serde_json::Value =
        serde_saphyr::from_slice(t1.workflow_payload.as_deref().unwrap()).unwrap();
    assert_eq!(
        p1["jobs"]["first"]["runs-on"], "pod",
        "one label is a scalar"
    );

    let ctx = t2.context.as_option().unwrap();
    let s = |k: &str| ctx.get(k).and_then(|v| v.as_str()).map(str::to_owned);
    assert_eq!(s("repository").as_deref(), Some("octo/app"));
    assert_eq!(s("repository_owner").as_deref(), Some("octo"));
    assert_eq!(s("job").as_deref(), Some("second"));
    assert_eq!(s("workflow").as_deref(), Some("pipeline"));
    assert_eq!(s("event_name").as_deref(), Some("push"));
    assert_eq!(s("run_attempt").as_deref(), Some("1"));
    assert_eq!(s("server_url"), Some(format!("{}/", mock.url)));
    assert_eq!(s("api_url"), Some(format!("{}/api/v1", mock.url)));
    for key in [
        "run_id",
        "run_number",
        "ref",
        "sha",
        "actor",
        "gitea_default_actions_url",
    ] {
        assert!(s(key).is_some_and(|v| !v.is_empty()), "context.{key}");
    }
    let token = s("token").unwrap();
    assert_eq!(t2.secrets.get("GITHUB_TOKEN"), Some(&token));
    assert_eq!(t2.secrets.get("GITEA_TOKEN"), Some(&token));
    assert_eq!(
        t2.secrets.get("DEPLOY_KEY").map(String::as_str),
        Some("s3cret")
    );
    assert_eq!(t2.vars.get("REGION").map(String::as_str), Some("eu"));
    assert_eq!(mock.handle.job(jobs[1]).unwrap().task.unwrap().token, token);
}

/// Peer fidelity: a run's trigger reaches the task context as Gitea writes it
/// (`services/actions/context.go`): `pull_request` with `ref` `refs/pull/<n>/head`,
/// `pull_request_target` with `ref` rewritten to the base branch, both with `base_ref`,
/// `head_ref` and the pull request's number in `event`; a push without them.
#[tokio::test]
async fn the_task_context_tells_the_trigger_as_gitea_does() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    let yaml = "on: push\njobs:\n  j:\n    runs-on: pod\n    steps: []\n";
    let pr = |number| (number, "feature".to_owned(), "main".to_owned());
    for (trigger, event_name, git_ref, pull) in [
        (Trigger::default(), "push", "refs/heads/main", None),
        (
            Trigger::Push("refs/tags/v1".into()),
            "push",
            "refs/tags/v1",
            None,
        ),
        (
            Trigger::PullRequest {
                number: 4,
                head: "feature".into(),
                base: "main".into(),
            },
            "pull_request",
            "refs/pull/4/head",
            Some(pr(4)),
        ),
        (
            Trigger::PullRequestTarget {
                number: 5,
                head: "feature".into(),
                base: "main".into(),
            },
            "pull_request_target",
            "refs/heads/main",
            Some(pr(5)),
        ),
    ] {
        mock.handle
            .queue_workflow_for("octo/app", &trigger, yaml)
            .unwrap();
        let task = fetch_task(&c).await;
        let ctx = task.context.as_option().unwrap();
        let s = |k: &str| ctx.get(k).and_then(|v| v.as_str()).map(str::to_owned);
        assert_eq!(s("event_name").as_deref(), Some(event_name), "{trigger:?}");
        assert_eq!(s("ref").as_deref(), Some(git_ref), "{trigger:?}");
        let event = ctx.get("event").and_then(|v| v.as_struct()).unwrap();
        let number = event
            .get("pull_request")
            .and_then(|v| v.as_struct())
            .and_then(|p| p.get("number"))
            .and_then(|v| v.as_number());
        match pull {
            Some((n, head, base)) => {
                assert_eq!(s("head_ref"), Some(head));
                assert_eq!(s("base_ref"), Some(base));
                assert_eq!(number, Some(n as f64));
            }
            None => {
                assert_eq!(s("head_ref").as_deref(), Some(""));
                assert_eq!(number, None);
            }
        }
    }
    mock.handle
        .queue_workflow_for("octo/app", &Trigger::NoRef, yaml)
        .unwrap();
    let task = fetch_task(&c).await;
    assert!(task.context.as_option().unwrap().get("ref").is_none());
}

/// Peer fidelity: a matrix of plain lists becomes one job per combination, as Gitea's
/// jobparser expands it: every task has the same repository and job key (`context.job`),
/// its own task ID and token, and a name carrying its values. The mock says "not
/// supported" for what it cannot evaluate (`include`/`exclude`, expressions) instead of
/// serving tasks Gitea would not.
#[tokio::test]
async fn a_matrix_job_becomes_one_task_per_combination_with_the_same_repository_and_job_key() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["l"], false);
    let jobs = mock
        .handle
        .queue_workflow(
            "o/r",
            "on: push\njobs:\n  m:\n    runs-on: l\n    strategy:\n      matrix:\n        v: [1, 2, 3]\n",
        )
        .unwrap();
    assert_eq!(jobs.len(), 3);
    let mut tokens = HashSet::new();
    for _ in 0..3 {
        let task = fetch_task(&c).await;
        let ctx = task.context.as_option().unwrap();
        let s = |k: &str| ctx.get(k).and_then(|v| v.as_str()).map(str::to_owned);
        assert_eq!(s("repository").as_deref(), Some("o/r"));
        assert_eq!(s("job").as_deref(), Some("m"));
        tokens.insert(s("token").unwrap());
    }
    assert_eq!(tokens.len(), 3, "each task has its own token");
    let mut names: Vec<String> = jobs
        .iter()
        .map(|j| mock.handle.job(*j).unwrap().name)
        .collect();
    names.sort();
    assert_eq!(names, ["m (1)", "m (2)", "m (3)"]);
    let err = mock
        .handle
        .queue_workflow(
            "o/r",
            "on: push\njobs:\n  m:\n    runs-on: l\n    strategy:\n      matrix:\n        include: [{v: 1}]\n",
        )
        .unwrap_err();
    assert!(err.to_string().contains("not supported"), "{err}");
}

/// Peer fidelity: only the runner that fetched a task may update it or its log; another runner
/// gets Gitea's `invalid runner for task` and changes nothing.
#[tokio::test]
async fn only_the_fetching_runner_may_update_a_task() {
    let mock = start().await;
    let (owner, _) = runner(&mock, &["self-hosted", "pod"], false);
    let (other, _) = runner(&mock, &["self-hosted", "pod"], false);
    mock.handle.queue_workflow("o/r", ONE_JOB).unwrap();
    let task = fetch_task(&owner).await;

    let err = update(&other, state(task.id, pb::TaskResult::RESULT_SUCCESS), &[])
        .await
        .unwrap_err();
    assert_gitea_error(&err, "Internal", "update task: invalid runner for task");
    let err = log(&other, task.id, 0, &["x"], false).await.unwrap_err();
    assert_gitea_error(&err, "Internal", "get task: invalid runner for task");

    let snap = mock.handle.task(task.id).unwrap();
    assert_eq!(snap.status, Status::Running);
    assert!(snap.log_rows.is_empty());
    heartbeat(&owner, task.id).await;
}

/// Peer fidelity: Gitea answers an unknown task with its internal-error wrapping of `util.ErrNotExist`,
/// not with `NotFound` (its handlers return `status.Errorf(codes.Internal, …)`).
#[tokio::test]
async fn updating_an_unknown_task_is_an_internal_resource_does_not_exist() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["l"], false);
    let err = update(&c, state(4242, pb::TaskResult::RESULT_UNSPECIFIED), &[])
        .await
        .unwrap_err();
    assert_gitea_error(
        &err,
        "Internal",
        "update task: task with id 4242: resource does not exist",
    );
}

/// Peer fidelity: a heartbeat (an UpdateTask without a result) moves the task's `updated` time
/// forward, which Gitea's zombie sweep reads, and keeps the task running.
#[tokio::test]
async fn a_heartbeat_moves_the_tasks_updated_time_forward() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    mock.handle.queue_workflow("o/r", ONE_JOB).unwrap();
    let task = fetch_task(&c).await;
    let before = mock.handle.task(task.id).unwrap();
    assert_eq!(before.heartbeats, 0);

    let resp = heartbeat(&c, task.id).await;
    assert_eq!(result_of(&resp), pb::TaskResult::RESULT_UNSPECIFIED as i32);
    let after = mock.handle.task(task.id).unwrap();
    assert_eq!(after.heartbeats, 1);
    assert!(after.updated > before.updated, "updated moves forward");
    assert_eq!(after.status, Status::Running);
}

/// Peer fidelity: a result finalises the task and its job (steps, stop time); later updates and
/// heartbeats change nothing and are answered with the stored result, as in Gitea.
#[tokio::test]
async fn a_result_finalises_the_task_and_later_updates_change_nothing() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    let job = mock.handle.queue_workflow("o/r", ONE_JOB).unwrap()[0];
    let task = fetch_task(&c).await;

    let mut done = state(task.id, pb::TaskResult::RESULT_SUCCESS);
    done.stopped_at = buffa::MessageField::some(buffa_types::google::protobuf::Timestamp::now());
    done.steps = vec![pb::StepState {
        id: 0,
        result: pb::TaskResult::RESULT_SUCCESS.into(),
        log_index: 0,
        log_length: 3,
        ..Default::default()
    }];
    let resp = update(&c, done, &[]).await.unwrap();
    assert_eq!(result_of(&resp), pb::TaskResult::RESULT_SUCCESS as i32);
    let snap = mock.handle.task(task.id).unwrap();
    assert_eq!(snap.status, Status::Success);
    assert!(snap.stopped.is_some());
    assert_eq!(snap.steps.len(), 1);
    assert_eq!((snap.steps[0].log_index, snap.steps[0].log_length), (0, 3));
    assert_eq!(mock.handle.job(job).unwrap().status, Status::Success);

    let resp = update(&c, state(task.id, pb::TaskResult::RESULT_FAILURE), &[])
        .await
        .unwrap();
    assert_eq!(result_of(&resp), pb::TaskResult::RESULT_SUCCESS as i32);
    heartbeat(&c, task.id).await;
    let later = mock.handle.task(task.id).unwrap();
    assert_eq!(later.status, Status::Success);
    assert_eq!(later.heartbeats, 0);
    assert_eq!(later.stopped, snap.stopped);
}

/// Peer fidelity: without the `cancelling` capability, cancelling a job stops its task at once
/// and the next update is answered `RESULT_CANCELLED`, as in Gitea.
#[tokio::test]
async fn a_cancelled_job_answers_cancelled_on_the_next_update() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    let job = mock.handle.queue_workflow("o/r", ONE_JOB).unwrap()[0];
    let task = fetch_task(&c).await;
    mock.handle.cancel_job(job).unwrap();

    // Without the `cancelling` capability Gitea stops the task at once.
    assert_eq!(mock.handle.task(task.id).unwrap().status, Status::Cancelled);
    let resp = heartbeat(&c, task.id).await;
    assert_eq!(result_of(&resp), pb::TaskResult::RESULT_CANCELLED as i32);
}

/// Peer fidelity: with the `cancelling` capability a cancelled task stays `Cancelling` until
/// its runner reports, every answer says cancelled, and any final result is stored as
/// cancelled.
#[tokio::test]
async fn a_runner_with_the_cancelling_capability_finishes_a_cancelled_task_as_cancelled() {
    let mock = start().await;
    let (c, uuid) = runner(&mock, &[], false);
    c.declare(pb::DeclareRequest {
        version: "v3".into(),
        labels: vec!["self-hosted".into(), "pod".into()],
        capabilities: vec!["cancelling".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(
        mock.handle.runner(&uuid).unwrap().capabilities,
        vec!["cancelling"]
    );
    let job = mock.handle.queue_workflow("o/r", ONE_JOB).unwrap()[0];
    let task = fetch_task(&c).await;
    mock.handle.cancel_job(job).unwrap();

    assert_eq!(
        mock.handle.task(task.id).unwrap().status,
        Status::Cancelling
    );
    let resp = heartbeat(&c, task.id).await;
    assert_eq!(
        result_of(&resp),
        pb::TaskResult::RESULT_CANCELLED as i32,
        "still running, already cancelled on the wire"
    );
    let resp = update(&c, state(task.id, pb::TaskResult::RESULT_FAILURE), &[])
        .await
        .unwrap();
    assert_eq!(result_of(&resp), pb::TaskResult::RESULT_CANCELLED as i32);
    assert_eq!(mock.handle.task(task.id).unwrap().status, Status::Cancelled);
}

/// Peer fidelity: a job cancelled while waiting is never offered.
#[tokio::test]
async fn cancelling_a_waiting_job_means_it_is_never_offered() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    let job = mock.handle.queue_workflow("o/r", ONE_JOB).unwrap()[0];
    mock.handle.cancel_job(job).unwrap();
    assert_eq!(mock.handle.job(job).unwrap().status, Status::Cancelled);
    assert!(fetch(&c, 0).await.unwrap().task.is_unset());
}

/// Peer fidelity: task outputs are insert-if-absent (the first value wins), a key over 255
/// characters is dropped, and `sent_outputs` lists every stored key, as in Gitea.
#[tokio::test]
async fn outputs_are_insert_if_absent_and_sent_outputs_lists_every_stored_key() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    mock.handle.queue_workflow("o/r", ONE_JOB).unwrap();
    let task = fetch_task(&c).await;
    let hb = state(task.id, pb::TaskResult::RESULT_UNSPECIFIED);

    let resp = update(&c, hb.clone(), &[("a", "1")]).await.unwrap();
    assert_eq!(resp.sent_outputs, vec!["a"]);
    let long_key = "k".repeat(256);
    let resp = update(&c, hb, &[("a", "2"), ("b", "3"), (long_key.as_str(), "x")])
        .await
        .unwrap();
    let mut sent = resp.sent_outputs.clone();
    sent.sort();
    assert_eq!(sent, vec!["a", "b"], "a too-long key is dropped");
    let outputs = mock.handle.task(task.id).unwrap().outputs;
    assert_eq!(
        outputs.get("a").map(String::as_str),
        Some("1"),
        "first value wins"
    );
    assert_eq!(outputs.get("b").map(String::as_str), Some("3"));
}

/// Peer fidelity: Gitea appends log rows only from its ack index on: an overlapping batch adds
/// its new rows, an old batch nothing.
#[tokio::test]
async fn log_rows_are_appended_only_at_the_ack_index() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    mock.handle.queue_workflow("o/r", ONE_JOB).unwrap();
    let task = fetch_task(&c).await;

    assert_eq!(log(&c, task.id, 0, &["a", "b"], false).await.unwrap(), 2);
    // Overlapping batch: only the rows from the ack index on are new.
    assert_eq!(log(&c, task.id, 1, &["b", "c"], false).await.unwrap(), 3);
    // Fully old batch: nothing written.
    assert_eq!(log(&c, task.id, 0, &["a"], false).await.unwrap(), 3);
    assert_eq!(
        mock.handle.task(task.id).unwrap().log_rows,
        vec!["a", "b", "c"]
    );
}

/// Peer fidelity: a log batch starting past the ack index (a gap) is not written and never
/// archives the log.
#[tokio::test]
async fn a_log_gap_is_not_written() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    mock.handle.queue_workflow("o/r", ONE_JOB).unwrap();
    let task = fetch_task(&c).await;

    assert_eq!(log(&c, task.id, 1, &["a"], false).await.unwrap(), 0);
    assert_eq!(log(&c, task.id, 5, &["x"], true).await.unwrap(), 0);
    let snap = mock.handle.task(task.id).unwrap();
    assert!(snap.log_rows.is_empty());
    assert!(!snap.log_archived, "a gap never archives");
}

/// Peer fidelity: `no_more` archives the log; later rows get Gitea's `AlreadyExists` `log file
/// has been archived`, and re-sending the empty finalize is acknowledged, idempotently.
#[tokio::test]
async fn no_more_archives_the_log_and_later_rows_are_refused() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    mock.handle.queue_workflow("o/r", ONE_JOB).unwrap();
    let task = fetch_task(&c).await;

    assert_eq!(log(&c, task.id, 0, &["a"], true).await.unwrap(), 1);
    assert!(mock.handle.task(task.id).unwrap().log_archived);
    let err = log(&c, task.id, 1, &["b"], false).await.unwrap_err();
    assert_gitea_error(&err, "AlreadyExists", "log file has been archived");
    // Re-sending the (empty) finalize is acknowledged, idempotently.
    assert_eq!(log(&c, task.id, 1, &[], true).await.unwrap(), 1);
    assert_eq!(log(&c, task.id, 1, &[], true).await.unwrap(), 1);
    assert_eq!(mock.handle.task(task.id).unwrap().log_rows, vec!["a"]);
}

/// Peer fidelity: an empty batch with `no_more` archives the log.
#[tokio::test]
async fn an_empty_finalize_archives_the_log() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    mock.handle.queue_workflow("o/r", ONE_JOB).unwrap();
    let task = fetch_task(&c).await;
    assert_eq!(log(&c, task.id, 0, &[], true).await.unwrap(), 0);
    assert!(mock.handle.task(task.id).unwrap().log_archived);
}

/// Peer fidelity: Gitea's zombie sweep fails a task idle longer than its timeout (10 minutes in
/// Gitea, 1 s here), archives its log, and answers later heartbeats with the failure.
#[tokio::test]
async fn an_idle_task_is_failed_by_the_zombie_sweeper() {
    let mock = start_with(MockConfig::default().with_zombie_timeout(Duration::from_secs(1))).await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    let job = mock.handle.queue_workflow("o/r", ONE_JOB).unwrap()[0];
    let task = fetch_task(&c).await;

    mock.handle
        .wait_for(
            |m| m.task(task.id).is_some_and(|t| t.status == Status::Failure),
            WAIT,
        )
        .await
        .unwrap();
    let snap = mock.handle.task(task.id).unwrap();
    assert!(snap.log_archived && snap.stopped.is_some());
    assert_eq!(mock.handle.job(job).unwrap().status, Status::Failure);
    let resp = heartbeat(&c, task.id).await;
    assert_eq!(result_of(&resp), pb::TaskResult::RESULT_FAILURE as i32);
}

/// Peer fidelity: the zombie sweep fails only tasks idle longer than the timeout; a fresh task
/// is not a zombie.
#[tokio::test]
async fn sweeping_now_fails_only_tasks_idle_longer_than_the_timeout() {
    let mock = start_with(
        MockConfig {
            // The background sweeper stays out of the way; the test sweeps by hand.
            sweep_interval: Some(Duration::from_secs(3600)),
            ..MockConfig::default()
        }
        .with_zombie_timeout(Duration::from_secs(2)),
    )
    .await;
    let (c, _) = runner(&mock, &["self-hosted", "pod"], false);
    mock.handle.queue_workflow("o/r", ONE_JOB).unwrap();
    let task = fetch_task(&c).await;
    assert_eq!(
        mock.handle.sweep_zombies_now(),
        0,
        "a fresh task is not a zombie"
    );
    let started = mock.handle.task(task.id).unwrap().updated;
    mock.handle
        .wait_for(
            |_| {
                started
                    .elapsed()
                    .is_ok_and(|e| e > Duration::from_millis(2100))
            },
            WAIT,
        )
        .await
        .unwrap();
    assert_eq!(mock.handle.sweep_zombies_now(), 1);
    assert_eq!(mock.handle.task(task.id).unwrap().status, Status::Failure);
}

/// Peer fidelity: an ephemeral runner gets one task and is removed once it finishes; its
/// credentials are then an `unregistered runner`, as in Gitea.
#[tokio::test]
async fn an_ephemeral_runner_is_removed_after_its_task_finishes() {
    let mock = start().await;
    let (c, uuid) = runner(&mock, &["l"], true);
    mock.handle
        .queue_workflow("o/r", &job_with_script("a", "l", "1"))
        .unwrap();
    mock.handle
        .queue_workflow("o/r", &job_with_script("b", "l", "2"))
        .unwrap();
    let task = fetch_task(&c).await;
    assert!(
        fetch(&c, 0).await.unwrap().task.is_unset(),
        "no second task while the first is unfinished"
    );
    update(&c, state(task.id, pb::TaskResult::RESULT_SUCCESS), &[])
        .await
        .unwrap();
    assert!(mock.handle.runner(&uuid).is_none());
    let err = fetch(&c, 0).await.unwrap_err();
    assert_gitea_error(&err, "Unauthenticated", "unregistered runner");
}

/// Peer fidelity: missing or wrong runner credentials get Gitea's `unregistered runner`, on the
/// wire as Gitea sends it: HTTP 500, Connect code `unknown`, the gRPC status as text.
#[tokio::test]
async fn unknown_runners_get_gitea_style_unauthenticated_errors() {
    let mock = start().await;
    let (_, token) = mock.handle.create_runner("r", &["l"], false);
    for c in [
        anonymous(&mock),
        authed(&mock, "no-such-uuid", "x"),
        authed(&mock, "no-such-uuid", &token),
    ] {
        let err = fetch(&c, 0).await.unwrap_err();
        assert_gitea_error(&err, "Unauthenticated", "unregistered runner");
    }
    let (uuid, _) = mock.handle.create_runner("r2", &["l"], false);
    let err = fetch(&authed(&mock, &uuid, "wrong"), 0).await.unwrap_err();
    assert_gitea_error(&err, "Unauthenticated", "unregistered runner");

    // On the wire: HTTP 500 with a JSON body whose code is `unknown`.
    let resp = reqwest::Client::new()
        .post(format!(
            "{}/runner.v1.RunnerService/FetchTask",
            mock.api_url()
        ))
        .header("content-type", "application/json")
        .header("connect-protocol-version", "1")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 500);
    let body = resp.text().await.unwrap();
    assert!(body.contains(r#""code":"unknown""#), "{body}");
    assert!(
        body.contains("rpc error: code = Unauthenticated desc = unregistered runner"),
        "{body}"
    );
}

/// Peer fidelity: answers of 1 KiB and more are gzip-compressed when the client accepts it,
/// smaller ones are not, as Gitea's handler does.
#[tokio::test]
async fn responses_of_1kib_and_more_are_gzipped() {
    let mock = start().await;
    let (uuid, token) = mock.handle.create_runner("r", &["l"], false);
    let big = "x".repeat(4096);
    mock.handle
        .queue_workflow("o/r", &job_with_script("a", "l", &big))
        .unwrap();

    let http = reqwest::Client::new();
    let post = |method: &str, body: &'static str| {
        http.post(format!("{}/{method}", mock.api_url()))
            .header("content-type", "application/json")
            .header("connect-protocol-version", "1")
            .header("accept-encoding", "gzip")
            .header("x-runner-uuid", uuid.as_str())
            .header("x-runner-token", token.as_str())
            .body(body)
    };
    let big_resp = post("runner.v1.RunnerService/FetchTask", "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(big_resp.status().as_u16(), 200);
    assert_eq!(
        big_resp
            .headers()
            .get("content-encoding")
            .and_then(|v| v.to_str().ok()),
        Some("gzip")
    );
    let small = post("ping.v1.PingService/Ping", r#"{"data":"a"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(small.status().as_u16(), 200);
    assert!(small.headers().get("content-encoding").is_none());

    // The generated client asks for gzip too and decodes the big task.
    mock.handle
        .queue_workflow("o/r", &job_with_script("b", "l", &big))
        .unwrap();
    let task = fetch_task(&authed(&mock, &uuid, &token)).await;
    assert!(task.workflow_payload.unwrap().len() > 4096);
}

/// Peer fidelity: Register needs an active registration token and a name, answers Gitea's
/// messages otherwise, and records labels, version, capabilities and ephemerality; the
/// credentials it returns work.
#[tokio::test]
async fn registration_needs_an_active_token() {
    let mock = start().await;
    let c = anonymous(&mock);
    let req = |token: &str, name: &str| pb::RegisterRequest {
        name: name.into(),
        token: token.into(),
        version: "v3.3.0".into(),
        labels: vec!["self-hosted".into(), "pod".into()],
        ephemeral: true,
        capabilities: vec!["cancelling".into()],
        ..Default::default()
    };
    let err = c.register(req("nope", "r1")).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Unknown);
    assert_eq!(
        err.message.as_deref(),
        Some("runner registration token not found")
    );

    mock.handle.add_registration_token("tok");
    let err = c.register(req("tok", "")).await.unwrap_err();
    assert_eq!(err.message.as_deref(), Some("missing runner token, name"));

    let runner = c
        .register(req("tok", "r1"))
        .await
        .unwrap()
        .into_owned()
        .runner
        .into_option()
        .unwrap();
    assert!(runner.id > 0 && !runner.uuid.is_empty() && !runner.token.is_empty());
    assert_eq!(runner.name, "r1");
    assert_eq!(runner.version, "v3.3.0");
    assert_eq!(runner.labels, vec!["self-hosted", "pod"]);
    assert!(runner.ephemeral);
    let snap = mock.handle.runner(&runner.uuid).unwrap();
    assert_eq!(snap.capabilities, vec!["cancelling"]);
    assert!(snap.ephemeral);
    // The credentials it got work.
    fetch(&authed(&mock, &runner.uuid, &runner.token), 0)
        .await
        .unwrap();

    mock.handle.invalidate_registration_token("tok");
    let err = c.register(req("tok", "r2")).await.unwrap_err();
    assert_eq!(
        err.message.as_deref(),
        Some("runner registration token has been invalidated, please use the latest one")
    );
}

/// Peer fidelity: Declare replaces the runner's labels and version and answers Gitea's
/// `x-gitea-actions-capabilities` header.
#[tokio::test]
async fn declare_answers_the_capabilities_header() {
    let mock = start().await;
    let (c, uuid) = runner(&mock, &["old"], false);
    let resp = c
        .declare(pb::DeclareRequest {
            version: "v3.3.0".into(),
            labels: vec!["self-hosted".into(), "vm".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        resp.headers()
            .get("x-gitea-actions-capabilities")
            .and_then(|v| v.to_str().ok()),
        Some("job-summary")
    );
    let runner = resp.into_owned().runner.into_option().unwrap();
    assert_eq!(runner.uuid, uuid);
    assert_eq!(runner.labels, vec!["self-hosted", "vm"]);
    let snap = mock.handle.runner(&uuid).unwrap();
    assert_eq!(snap.labels, vec!["self-hosted", "vm"]);
    assert_eq!(snap.version, "v3.3.0");
}

/// Peer fidelity: Gitea's PingService answers `Hello, <data>!`.
#[tokio::test]
async fn ping_answers_hello() {
    let mock = start().await;
    let c = ping::PingServiceClient::new(HttpClient::plaintext(), config(&mock));
    let resp = c
        .ping(ping::PingRequest {
            data: "gitea".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_owned();
    assert_eq!(resp.data, "Hello, gitea!");
}

/// Peer harness: injected faults reproduce what can sit between a runner and Gitea (a proxy's
/// Connect error, a Gitea error, an HTTP 502 page, a slow answer), each failing only the next
/// call.
#[tokio::test]
async fn injected_faults_fail_only_the_next_call() {
    let mock = start().await;
    let (c, _) = runner(&mock, &["l"], false);
    mock.handle.fail_next(
        RpcMethod::FetchTask,
        MockFault::Connect {
            code: ErrorCode::Unavailable,
            message: "proxy says no".into(),
        },
    );
    mock.handle.fail_next(
        RpcMethod::FetchTask,
        MockFault::Gitea {
            code: GrpcCode::Internal,
            desc: "pick task: database is locked".into(),
        },
    );
    mock.handle.fail_next(
        RpcMethod::FetchTask,
        MockFault::Http {
            status: 502,
            body: "<html>bad gateway</html>".into(),
        },
    );
    let err = fetch(&c, 0).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Unavailable);
    let err = fetch(&c, 0).await.unwrap_err();
    assert_gitea_error(&err, "Internal", "pick task: database is locked");
    let err = fetch(&c, 0).await.unwrap_err();
    assert_eq!(
        err.code,
        ErrorCode::Unavailable,
        "502 maps to unavailable: {err:?}"
    );
    fetch(&c, 0).await.unwrap();

    mock.handle.fail_next(
        RpcMethod::FetchTask,
        MockFault::Delay(Duration::from_secs(3)),
    );
    let err = c
        .fetch_task_with_options(
            pb::FetchTaskRequest::default(),
            CallOptions::default().with_timeout(Duration::from_millis(200)),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::DeadlineExceeded, "{err:?}");
}

/// Peer harness: the admin API queues workflows, lists and cancels jobs and adds registration
/// tokens over HTTP, and refuses a broken workflow with 400.
#[tokio::test]
async fn the_admin_api_queues_lists_and_cancels_jobs() {
    let mock = start().await;
    let http = reqwest::Client::new();
    let resp = http
        .post(format!("{}/_mock/workflows?repo=o/r", mock.url))
        .body(ONE_JOB)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let ids: serde_json::Value = resp.json().await.unwrap();
    let id = ids["job_ids"][0].as_i64().unwrap();

    let jobs: serde_json::Value = http
        .get(format!("{}/_mock/jobs", mock.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(jobs[0]["id"], id);
    assert_eq!(jobs[0]["status"], "waiting");

    let resp = http
        .post(format!("{}/_mock/jobs/{id}/cancel", mock.url))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
    assert_eq!(
        mock.handle.job(JobId(id)).unwrap().status,
        Status::Cancelled
    );

    let resp = http
        .post(format!("{}/_mock/registration-tokens", mock.url))
        .body("admin-token")
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
    anonymous(&mock)
        .register(pb::RegisterRequest {
            name: "r".into(),
            token: "admin-token".into(),
            ..Default::default()
        })
        .await
        .unwrap();

    let bad = http
        .post(format!("{}/_mock/workflows?repo=o/r", mock.url))
        .body("jobs: [")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status().as_u16(), 400);
}

/// Peer harness: the blob endpoint (standing in for checkouts and artifact downloads) streams
/// deterministic bytes, and every non-API request is recorded.
#[tokio::test]
async fn the_blob_endpoint_streams_deterministic_bytes_and_requests_are_recorded() {
    let mock = start().await;
    let http = reqwest::Client::new();
    let n: usize = 300_000;
    let resp = http
        .get(format!("{}/_mock/blob/{n}", mock.url))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let body = resp.bytes().await.unwrap();
    assert_eq!(body.len(), n);
    assert!(
        body.iter()
            .enumerate()
            .all(|(i, b)| usize::from(*b) == i % 251)
    );

    let missing = http
        .get(format!("{}/nowhere?x=1", mock.url))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status().as_u16(), 404);
    assert_eq!(
        mock.handle.seen_requests(),
        vec![format!("/_mock/blob/{n}"), "/nowhere?x=1".to_owned()]
    );
}

/// Peer harness: waiting on the mock's state wakes on a change and times out otherwise.
#[tokio::test]
async fn waiting_on_state_wakes_on_change_and_times_out_otherwise() {
    let mock = start().await;
    let handle = mock.handle.clone();
    let waiter = tokio::spawn(async move {
        handle
            .wait_for_value(|m| m.jobs().first().map(|j| j.id), WAIT)
            .await
    });
    let id = mock.handle.queue_workflow("o/r", ONE_JOB).unwrap()[0];
    assert_eq!(waiter.await.unwrap().unwrap(), id);
    let err = mock
        .handle
        .wait_for(|m| m.jobs().len() > 5, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not met"), "{err}");
}

/// Peer harness: the mock serves the listener it is given and stops when its shutdown signal
/// resolves.
#[tokio::test]
async fn serve_stops_when_shutdown_resolves() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        MockGitea::new(MockConfig::default()).serve(listener, async {
            let _ = rx.await;
        }),
    );
    let resp = reqwest::get(format!("http://{addr}/_mock/jobs"))
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    drop(resp);
    tx.send(()).unwrap();
    tokio::time::timeout(WAIT, server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();

    let running = start().await;
    running.shutdown().await.unwrap();
}
