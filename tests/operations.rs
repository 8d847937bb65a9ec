//! Operating the controller, as an operator sees it, against a real controller process
//! (embedded nats-server, process backend, stand-in runner, mock Gitea): the job-life log
//! events, `/status` with the `status` command and the status page in headless Chromium,
//! and the metrics the dashboard and alert rules under `deploy/` use.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gdr_controller::status::{Phase, StatusReport};
use gdr_testkit::browser::Chromium;
use gdr_testkit::controller::{ControllerFixture, listener};
use gdr_testkit::mock_gitea::{JobId, MockConfig, MockGitea, RunningMock, Status};
use gdr_testkit::nats_server::NatsServer;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(90);
const BIN: &str = env!("CARGO_BIN_EXE_gitea-dynamic-runner");
const STANDIN: &str = env!("CARGO_BIN_EXE_gitea-runner-standin");

/// A controller process with its own mock Gitea and embedded NATS.
struct Running {
    mock: RunningMock,
    fixture: ControllerFixture,
    health: std::net::SocketAddr,
    _child: tokio::process::Child,
    _listeners: (std::net::TcpListener, std::net::TcpListener),
}

impl Running {
    async fn start(pod_capacity: u32, vm_capacity: u32) -> Self {
        let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
        let facade = listener();
        let health = listener();
        let components = match vm_capacity {
            0 => "scheduler,pod-worker",
            _ => "scheduler,pod-worker,vm-worker",
        };
        let fixture = ControllerFixture::new(&mock, BIN.as_ref(), STANDIN.as_ref())
            .facade_at(facade.local_addr().expect("addr"))
            .set("components", components)
            .set("pod_capacity", pod_capacity)
            .set("vm_capacity", vm_capacity)
            .set("nats_server_binary", NatsServer::binary().as_path())
            .set("heartbeat_interval", "2s");
        let child = fixture.spawn(BIN.as_ref(), &facade, &health, &[]);
        let running = Running {
            mock,
            health: health.local_addr().expect("addr"),
            fixture,
            _child: child,
            _listeners: (facade, health),
        };
        gdr_testkit::until(WAIT, "the controller to be ready", || async {
            running.get("/readyz").await.is_some_and(|(s, _)| s == 200)
        })
        .await;
        running
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.health)
    }

    async fn get(&self, path: &str) -> Option<(u16, String)> {
        let response = reqwest::get(self.url(path)).await.ok()?;
        let status = response.status().as_u16();
        Some((status, response.text().await.ok()?))
    }

    async fn status(&self) -> StatusReport {
        let (code, body) = self.get("/status").await.expect("/status answers");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).expect("a status document")
    }

    async fn metrics(&self) -> String {
        self.get("/metrics").await.expect("/metrics answers").1
    }

    fn queue(&self, name: &str, step: &str) -> JobId {
        let yaml = format!(
            "on: push\njobs:\n  {name}:\n    runs-on: [self-hosted, pod]\n    steps:\n      - run: {step}\n"
        );
        self.mock
            .handle
            .queue_workflow("owner/repo", &yaml)
            .expect("queue")[0]
    }

    async fn wait_status(&self, job: JobId, status: Status) {
        self.mock
            .handle
            .wait_for(|m| m.job(job).is_some_and(|j| j.status == status), WAIT)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "job never reached {status:?}: {:?}\ncontroller log:\n{}",
                    self.mock.handle.job(job).map(|j| j.status),
                    self.fixture.log()
                )
            });
    }

    /// The assignment ID of a job once Gitea handed its task out.
    async fn assignment_id(&self, job: JobId) -> String {
        let task = self
            .mock
            .handle
            .wait_for_value(|m| m.job(job).and_then(|j| j.task).map(|t| t.id), WAIT)
            .await
            .expect("the job's task is handed out");
        format!("gitea-task-{task}")
    }

    /// The controller's JSON log lines about `assignment_id`.
    fn lines_of(&self, assignment_id: &str) -> Vec<Value> {
        self.fixture
            .log()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["assignment_id"] == assignment_id)
            .collect()
    }

    /// The `event` fields of those lines, in order.
    fn events_of(&self, assignment_id: &str) -> Vec<String> {
        self.lines_of(assignment_id)
            .iter()
            .filter_map(|v| v["event"].as_str().map(str::to_owned))
            .collect()
    }

    async fn events_until(&self, assignment_id: &str, last: &str) -> Vec<String> {
        gdr_testkit::eventually(
            WAIT,
            &format!("the {last} event of {assignment_id}"),
            || {
                let events = self.events_of(assignment_id);
                async move { events.iter().any(|e| e == last).then_some(events) }
            },
        )
        .await
    }
}

/// The value of one sample in OpenMetrics text.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// DESIGN invariant 24: an operator can follow one job through the logs by its
/// `assignment_id` alone — fetched, stored, admitted, executor created, identity bound,
/// claimed, terminal (with the result), cleaned — and a job the controller has to fail
/// says why and what happens next, and is counted by reason.
#[tokio::test(flavor = "multi_thread")]
async fn every_step_of_a_jobs_life_is_logged_with_its_assignment_id_and_a_crash_says_why() {
    let c = Running::start(1, 0).await;
    let ok = c.queue("build", "standin:success");
    let ok_id = c.assignment_id(ok).await;
    c.wait_status(ok, Status::Success).await;
    let mut events = c.events_until(&ok_id, "cleaned").await;
    // The worker may receive the assignment before the scheduler hears JetStream's
    // acknowledgement, so these two come in either order.
    if events.get(1..3) == Some(&["admitted".to_owned(), "stored".to_owned()][..]) {
        events.swap(1, 2);
    }
    assert_eq!(
        events,
        [
            "fetched",
            "stored",
            "admitted",
            "executor_created",
            "identity_bound",
            "claimed",
            "terminal",
            "cleaned"
        ],
        "the life of {ok_id} in the log:\n{}",
        c.fixture.log()
    );
    let lines = c.lines_of(&ok_id);
    let terminal = lines.iter().find(|l| l["event"] == "terminal").unwrap();
    assert_eq!(terminal["result"], "success", "{terminal}");
    let fetched = lines.iter().find(|l| l["event"] == "fetched").unwrap();
    assert_eq!(
        (fetched["repository"].as_str(), fetched["job_key"].as_str()),
        (Some("owner/repo"), Some("build"))
    );
    // Every line that names the assignment carries it as its field, so one filter finds
    // the whole story.
    for line in c.fixture.log().lines().filter(|l| l.contains(&ok_id)) {
        let v: Value = serde_json::from_str(line).expect("JSON log line");
        assert_eq!(v["assignment_id"], ok_id.as_str(), "{line}");
    }

    // The runner dies after the claim without a result: the controller fails the job.
    let crash = c.queue("crash", "standin:crash");
    let crash_id = c.assignment_id(crash).await;
    c.wait_status(crash, Status::Failure).await;
    let events = c.events_until(&crash_id, "cleaned").await;
    let tail: Vec<&str> = events
        .iter()
        .map(String::as_str)
        .skip_while(|e| *e != "claimed")
        .collect();
    assert_eq!(
        tail,
        ["claimed", "failing", "terminal", "cleaned"],
        "{events:?}"
    );
    let failing = c
        .lines_of(&crash_id)
        .into_iter()
        .find(|l| l["event"] == "failing")
        .unwrap();
    assert_eq!(failing["failure"], "ended_without_result", "{failing}");
    assert!(
        failing["reason"]
            .as_str()
            .is_some_and(|r| r.contains("ended without reporting a result")),
        "{failing}"
    );
    assert!(
        failing["message"]
            .as_str()
            .is_some_and(|m| m.contains("then cleaning up")),
        "the failure line says what happens next: {failing}"
    );

    let metrics = c.metrics().await;
    let pod =
        |name: &str, extra: &str| format!("gitea_dynamic_runner_{name}{{backend=\"pod\"{extra}}}");
    assert_eq!(
        sample(
            &metrics,
            &pod("jobs_completed_total", ",result=\"success\"")
        ),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            &pod("jobs_failed_total", ",reason=\"ended_without_result\"")
        ),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, &pod("queue_wait_seconds_count", "")),
        Some(2.0),
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, &pod("start_latency_seconds_count", "")),
        Some(2.0),
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, &pod("run_time_seconds_count", "")),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            "gitea_dynamic_runner_handoff_window_seconds_count"
        ),
        Some(2.0),
        "{metrics}"
    );
}

/// The rows of one `<table id=...>` in a DOM: each row's `data-*` attribute and cells.
fn rows(dom: &str, table: &str, attribute: &str) -> Vec<(String, Vec<String>)> {
    let start = dom
        .find(&format!("<table id=\"{table}\">"))
        .unwrap_or_else(|| panic!("no table {table} in:\n{dom}"));
    let body = &dom[start..];
    let body = &body[..body.find("</table>").expect("table ends")];
    body.split("<tr")
        .skip(1)
        .filter_map(|row| {
            let key = row
                .split(&format!("{attribute}=\""))
                .nth(1)?
                .split('"')
                .next()?
                .to_owned();
            let cells = row
                .split("<td")
                .skip(1)
                .filter_map(|c| Some(c.split_once('>')?.1.split("</td>").next()?.to_owned()))
                .collect();
            Some((key, cells))
        })
        .collect()
}

/// DESIGN invariant 24: `/status`, the `status` command and the status page show the same
/// observed state: the running job with its repository and job key, the queued one as
/// queued in JetStream, the pool full. The page renders in a real browser without script.
#[tokio::test(flavor = "multi_thread")]
async fn status_json_command_and_page_show_the_running_and_the_queued_job() {
    let c = Running::start(1, 0).await;
    let running = c.queue("hang", "standin:hang");
    let running_id = c.assignment_id(running).await;
    let queued = c.queue("later", "standin:success");
    let queued_id = c.assignment_id(queued).await;
    let report = gdr_testkit::eventually(
        WAIT,
        "one running and one queued job in /status",
        || async {
            let r = c.status().await;
            let pod = r.backends.first()?;
            let runs = r
                .assignments
                .iter()
                .any(|a| a.id == running_id && a.phase == Phase::Running && a.claimed);
            (runs && pod.queued_jetstream == Some(1) && pod.running == 1).then_some(r)
        },
    )
    .await;
    assert!(report.leader && report.ready, "{report:?}");
    let pod = &report.backends[0];
    assert_eq!(
        (pod.backend.as_str(), pod.capacity, pod.in_use),
        ("pod", 1, 1)
    );
    assert_eq!(pod.queued_gitea, None, "the runner protocol does not tell");
    let job = report
        .assignments
        .iter()
        .find(|a| a.id == running_id)
        .unwrap();
    assert_eq!(
        (job.repository.as_str(), job.job_key.as_str()),
        ("owner/repo", "hang")
    );
    assert!(job.last_event.starts_with("running"), "{job:?}");
    assert!(
        report.assignments.iter().all(|a| a.id != queued_id),
        "a queued job has no executor yet: {report:?}"
    );
    let raw = c.get("/status").await.unwrap().1;
    let secrets = [
        gdr_testkit::controller::CAPABILITY_KEY.to_owned(),
        c.mock.handle.task(job.task_id).unwrap().token,
    ];
    for secret in &secrets {
        assert!(
            !raw.contains(secret.as_str()),
            "/status leaks a secret: {raw}"
        );
    }

    // The command prints the same, as a table and as JSON.
    let base = format!("http://{}", c.health);
    let out = run_status(&["--url", &base]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8(out.stdout).unwrap();
    let pod_row = table.lines().find(|l| l.starts_with("pod ")).expect(&table);
    let cells: Vec<&str> = pod_row.split_whitespace().collect();
    assert_eq!(
        cells,
        ["pod", "1", "1", "0", "1", "0", "1", "unknown", "none"],
        "{table}"
    );
    let job_row = table
        .lines()
        .find(|l| l.starts_with(&running_id))
        .expect(&table);
    for cell in ["owner/repo", "hang", "running", "yes"] {
        assert!(job_row.contains(cell), "{cell} missing: {table}");
    }
    let out = run_status(&["--url", &base, "--json"]).await;
    let json: StatusReport = serde_json::from_slice(&out.stdout).expect("status --json");
    assert!(json.assignments.iter().any(|a| a.id == running_id));

    // The page, rendered by headless Chromium: the same rows, and a screenshot.
    let chromium = Chromium::find().unwrap_or_else(|e| panic!("{e}"));
    let dom = chromium
        .dump_dom(&c.url("/"))
        .await
        .expect("chromium renders the page");
    let backends = rows(&dom, "backends", "data-backend");
    assert_eq!(backends.len(), 1, "{dom}");
    assert_eq!(backends[0].0, "pod");
    assert_eq!(
        backends[0].1,
        ["pod", "1", "1", "0", "1", "0", "1", "unknown", "none"],
        "{dom}"
    );
    let jobs = rows(&dom, "assignments", "data-assignment-id");
    let (_, cells) = jobs.iter().find(|(id, _)| *id == running_id).expect(&dom);
    assert_eq!(
        &cells[1..6],
        ["owner/repo", "hang", "pod", "running", "yes"],
        "{dom}"
    );
    assert!(
        dom.contains("http-equiv=\"refresh\""),
        "the page reloads itself"
    );
    let shot = c.fixture.path().join("status.png");
    chromium
        .screenshot(&c.url("/"), &shot)
        .await
        .expect("screenshot");
    let png = std::fs::read(&shot).expect("the screenshot is written");
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 1000,
        "{} bytes",
        png.len()
    );
    keep_screenshot(&shot);

    // Once the first job ends, the queued one runs and the status empties.
    c.mock.handle.cancel_job(running).unwrap();
    c.wait_status(queued, Status::Success).await;
    gdr_testkit::until(WAIT, "an empty status", || async {
        let r = c.status().await;
        r.assignments.is_empty()
            && r.backends[0].queued_jetstream == Some(0)
            && r.backends[0].in_use == 0
    })
    .await;
}

async fn run_status(args: &[&str]) -> std::process::Output {
    let args: Vec<String> = std::iter::once("status".to_owned())
        .chain(args.iter().map(|a| (*a).to_owned()))
        .collect();
    tokio::process::Command::new(BIN)
        .args(&args)
        .env_clear()
        .output()
        .await
        .expect("binary runs")
}

/// CI keeps the screenshot when `GDR_SCREENSHOT_DIR` names a directory.
fn keep_screenshot(shot: &Path) {
    if let Some(dir) = std::env::var_os("GDR_SCREENSHOT_DIR") {
        let dir = PathBuf::from(dir);
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::copy(shot, dir.join("status-page.png"));
    }
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Every `gitea_dynamic_runner_*` name in a text.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("gitea_dynamic_runner_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// The PromQL expressions of the dashboard's panels.
fn dashboard_queries() -> Vec<String> {
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(repo("deploy/grafana/dashboard.json")).unwrap(),
    )
    .expect("the dashboard is JSON");
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.push(
                target["expr"]
                    .as_str()
                    .expect("a target has an expr")
                    .to_owned(),
            );
        }
    }
    out
}

/// The alert rules.
fn alert_rules() -> Vec<Value> {
    let text = std::fs::read_to_string(repo("deploy/prometheus/alerts.yaml")).unwrap();
    let doc: Value = serde_saphyr::from_str(&text).expect("the alert rules are YAML");
    doc["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .collect()
}

/// DESIGN invariant 24: the dashboard and the alerts use only metrics a running
/// controller exports (a renamed metric breaks this test, not a dashboard in production).
#[tokio::test(flavor = "multi_thread")]
async fn every_metric_the_dashboard_and_the_alerts_use_is_exported_by_a_running_controller() {
    let queries = dashboard_queries();
    let expressions: Vec<String> = alert_rules()
        .iter()
        .map(|r| r["expr"].as_str().expect("a rule has an expr").to_owned())
        .collect();
    let used: BTreeSet<String> = queries
        .iter()
        .chain(&expressions)
        .flat_map(|q| metric_names(q))
        .collect();
    assert!(used.len() >= 10, "the dashboard and alerts use {used:?}");

    let c = Running::start(1, 1).await;
    let metrics = c.metrics().await;
    let exported: BTreeSet<String> = metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect();
    let missing: Vec<&String> = used.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "not in /metrics: {missing:?}\n{metrics}"
    );
    // Each backend's series exist from the start, for both backends.
    for backend in ["pod", "vm"] {
        let series = format!("gitea_dynamic_runner_pool_capacity{{backend=\"{backend}\"}}");
        assert_eq!(sample(&metrics, &series), Some(1.0), "{metrics}");
    }
    assert_eq!(sample(&metrics, "gitea_dynamic_runner_leader"), Some(1.0));
    // `nats_connected` is sampled once a second: a client that reports its state a moment
    // after its connect returned (seen once in CI, the worker's) reads 1 from the next
    // sample on, and must.
    gdr_testkit::until(WAIT, "both NATS connections read as connected", || async {
        let metrics = c.metrics().await;
        ["producer", "worker"].iter().all(|connection| {
            let series =
                format!("gitea_dynamic_runner_nats_connected{{connection=\"{connection}\"}}");
            sample(&metrics, &series) == Some(1.0)
        })
    })
    .await;
}

/// The dashboard covers what operators ask (queue, start latency, outcomes, pools,
/// leader, handoff window) and every alert is complete: a name, an expression, a
/// duration, a severity and a summary; and Prometheus' own checker accepts the rules.
#[test]
fn the_dashboard_covers_each_question_and_the_alert_rules_parse() {
    let queries = dashboard_queries().join("\n");
    for metric in [
        "queue_depth",
        "queue_wait_seconds_bucket",
        "start_latency_seconds_bucket",
        "jobs_completed_total",
        "jobs_failed_total",
        "pool_in_use",
        "leader",
        "handoff_window_seconds_bucket",
    ] {
        assert!(
            queries.contains(&format!("gitea_dynamic_runner_{metric}")),
            "no panel uses {metric}"
        );
    }
    let rules = alert_rules();
    let names: BTreeSet<&str> = rules.iter().filter_map(|r| r["alert"].as_str()).collect();
    for alert in [
        "GiteaDynamicRunnerJobsFailedByController",
        "GiteaDynamicRunnerPoolSaturated",
        "GiteaDynamicRunnerNoLeader",
        "GiteaDynamicRunnerHandoffWindowHigh",
        "GiteaDynamicRunnerNatsUnreachable",
    ] {
        assert!(names.contains(alert), "missing alert {alert}: {names:?}");
    }
    for rule in &rules {
        for field in ["alert", "expr", "for"] {
            assert!(rule[field].is_string(), "{field} missing in {rule}");
        }
        assert!(
            rule["labels"]["severity"].is_string(),
            "severity missing in {rule}"
        );
        assert!(
            rule["annotations"]["summary"].is_string(),
            "summary missing in {rule}"
        );
    }
    let promtool = std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(repo("deploy/prometheus/alerts.yaml"))
        .output()
        .unwrap_or_else(|e| {
            panic!("promtool not found ({e}); install it with `apt-get install prometheus` (Debian) — .ci/run does")
        });
    assert!(
        promtool.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&promtool.stdout),
        String::from_utf8_lossy(&promtool.stderr)
    );
}
