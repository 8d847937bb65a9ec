//! The real Gitea, headless on loopback: built from its Go module by `tests/peers/build.sh`
//! (the binary, its version and the module's read-only copy of its templates and locales
//! come from `GITEA_BIN`, `GITEA_VERSION` and `GITEA_STATIC_ROOT`, which `.ci/run` exports),
//! SQLite under a temporary directory, Actions on, an admin with an API token, and a global
//! runner registration token. A test creates a repository, pushes workflows with `git` over
//! HTTP and reads what happened through Gitea's own API only.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;

use crate::controller::listener;

/// The admin every fixture creates; its repositories are `ci/<name>`.
pub const ADMIN: &str = "ci";
const ADMIN_PASSWORD: &str = "gdr-test-admin-password";
/// Gitea's start-up (migrations of a fresh SQLite database) takes seconds; only a bound on
/// a hang.
const START: Duration = Duration::from_secs(120);

/// The real peers' programs, from the environment `.ci/run` sets from
/// `tests/peers/build.sh`.
#[derive(Clone, Debug)]
pub struct Peers {
    /// The `gitea` server binary.
    pub gitea: PathBuf,
    /// The official runner (`gitea-runner`).
    pub runner: PathBuf,
    /// The Gitea module's own directory (templates, locales): `STATIC_ROOT_PATH`.
    pub static_root: PathBuf,
}

impl Peers {
    /// The peers named by `GITEA_BIN`, `GITEA_RUNNER_BIN` and `GITEA_STATIC_ROOT`; a test
    /// without them fails saying how to build them (it never passes without its peer).
    pub fn from_env() -> Peers {
        let var = |name: &str| {
            crate::peer_path(
                name,
                "the real-Gitea tests need the peers built from their Go module",
                "tests/peers/build.sh",
            )
        };
        Peers {
            gitea: var("GITEA_BIN"),
            runner: var("GITEA_RUNNER_BIN"),
            static_root: var("GITEA_STATIC_ROOT"),
        }
    }
}

/// What a test changes in Gitea's `app.ini`.
#[derive(Clone, Debug, Default)]
pub struct GiteaOptions {
    /// `[actions] ZOMBIE_TASK_TIMEOUT` (Gitea's default: 10 minutes) and, with it, the
    /// zombie clean-up's schedule (default every 5 minutes) set to every second.
    pub zombie_task_timeout: Option<Duration>,
}

/// A Gitea server process with its data directory; killed when dropped.
pub struct RealGitea {
    /// `http://127.0.0.1:<port>/`.
    pub url: url::Url,
    /// The global runner registration token (`GITEA_RUNNER_REGISTRATION_TOKEN`).
    pub registration_token: String,
    token: String,
    dir: tempfile::TempDir,
    peers: Peers,
    http: reqwest::Client,
    _server: tokio::process::Child,
}

/// A workflow run as `GET /repos/{owner}/{repo}/actions/runs` lists it.
#[derive(Clone, Debug, Deserialize)]
pub struct Run {
    /// The run's ID (also the web UI's `/actions/runs/{id}`).
    pub id: i64,
    /// `queued`, `in_progress`, `completed`, …
    pub status: String,
    /// `success`, `failure`, `cancelled`, … once completed.
    #[serde(default)]
    pub conclusion: String,
}

/// A job as `GET /repos/{owner}/{repo}/actions/jobs` lists it.
#[derive(Clone, Debug, Deserialize)]
pub struct Job {
    /// The job's ID (for its log).
    pub id: i64,
    /// The run it belongs to.
    pub run_id: i64,
    /// The job's name (a matrix job's name carries its values).
    pub name: String,
    /// `queued`, `waiting`, `in_progress`, `completed`.
    pub status: String,
    /// `success`, `failure`, `cancelled`, `skipped` once completed.
    #[serde(default)]
    pub conclusion: String,
    /// The runner that took it (Gitea's name for it), if any.
    #[serde(default)]
    pub runner_name: String,
}

impl Job {
    /// Gitea counts the job as done.
    pub fn is_completed(&self) -> bool {
        self.status == "completed"
    }
}

#[derive(Deserialize)]
struct Jobs {
    jobs: Vec<Job>,
}

#[derive(Deserialize)]
struct Runs {
    workflow_runs: Vec<Run>,
}

impl RealGitea {
    /// Starts a fresh Gitea: app.ini, migrations, the admin and its token, then `gitea web`
    /// on a listener this process bound (socket activation: no port is ever raced for).
    pub async fn start(peers: &Peers, options: GiteaOptions) -> RealGitea {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("no temporary directory: {e}"));
        // Gitea binds its own port: given a listener (LISTEN_FDS) by a parent other than
        // pid 1 it takes itself for the new process of a graceful restart and sends that
        // parent SIGTERM (modules/graceful, KillParent). `serve` retries on a clash.
        let port = free_port();
        let ini = dir.path().join("app.ini");
        std::fs::write(
            &ini,
            app_ini(dir.path(), &peers.static_root, port, &options),
        )
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", ini.display()));
        gitea(peers, dir.path(), &["migrate"]).await;
        let created = gitea(
            peers,
            dir.path(),
            &[
                "admin",
                "user",
                "create",
                "--username",
                ADMIN,
                "--password",
                ADMIN_PASSWORD,
                "--email",
                "ci@example.invalid",
                "--admin",
                "--must-change-password=false",
                "--access-token",
                "--access-token-scopes",
                "all",
            ],
        )
        .await;
        let token = created
            .lines()
            .find_map(|l| l.strip_prefix("Access token was successfully created... "))
            .unwrap_or_else(|| panic!("`gitea admin user create` printed no token:\n{created}"))
            .trim()
            .to_owned();
        let registration_token = registration_token();
        let (server, port) = serve(peers, dir.path(), port, &registration_token).await;
        RealGitea {
            url: loopback_url(port),
            registration_token,
            token,
            peers: peers.clone(),
            http: reqwest::Client::new(),
            _server: server,
            dir,
        }
    }

    /// Gitea's own log (`gitea web`'s console output).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("gitea.log")).unwrap_or_default()
    }

    /// The directory under which this Gitea keeps its data.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn api(&self, path: &str) -> url::Url {
        self.url
            .join(&format!("api/v1/{path}"))
            .unwrap_or_else(|e| panic!("api/v1/{path}: {e}"))
    }

    async fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> T {
        let answer = self
            .http
            .get(self.api(path))
            .header("authorization", format!("token {}", self.token))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        let status = answer.status();
        let body = answer.text().await.unwrap_or_default();
        assert!(status.is_success(), "GET {path}: {status}: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: {e}: {body}"))
    }

    /// Creates the empty repository `ci/<name>` (its Actions unit on, as by default).
    pub async fn create_repo(&self, name: &str) {
        let answer = self
            .http
            .post(self.api("user/repos"))
            .header("authorization", format!("token {}", self.token))
            .json(&serde_json::json!({ "name": name, "default_branch": "main" }))
            .send()
            .await
            .unwrap_or_else(|e| panic!("creating the repository {name}: {e}"));
        let status = answer.status();
        assert!(
            status.is_success(),
            "creating the repository {name}: {status}: {}",
            answer.text().await.unwrap_or_default()
        );
    }

    /// Commits `workflows` (file name, YAML) under `.gitea/workflows/` and pushes them to
    /// `ci/<repo>`'s `main` with `git` over HTTP; the push starts the runs.
    pub async fn push_workflows(&self, repo: &str, workflows: &[(&str, &str)]) {
        let work = self.dir.path().join("clones").join(repo);
        let flows = work.join(".gitea/workflows");
        std::fs::create_dir_all(&flows)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", flows.display()));
        for (name, yaml) in workflows {
            std::fs::write(flows.join(name), yaml)
                .unwrap_or_else(|e| panic!("cannot write the workflow {name}: {e}"));
        }
        let mut remote = self
            .url
            .join(&format!("{ADMIN}/{repo}.git"))
            .unwrap_or_else(|e| {
                panic!("the repository URL: {e}");
            });
        remote
            .set_username(ADMIN)
            .and_then(|()| remote.set_password(Some(&self.token)))
            .unwrap_or_else(|()| panic!("credentials in the remote URL"));
        let remote = remote.to_string();
        for args in [
            &["init", "--quiet", "--initial-branch", "main"][..],
            &["add", "."],
            &["commit", "--quiet", "--allow-empty", "-m", "workflows"],
            &["push", "--quiet", &remote, "HEAD:main"],
        ] {
            git(&work, self.dir.path(), args).await;
        }
    }

    /// Every job of `ci/<repo>`, newest first.
    pub async fn jobs(&self, repo: &str) -> Vec<Job> {
        let jobs: Jobs = self
            .get_json(&format!("repos/{ADMIN}/{repo}/actions/jobs?limit=50"))
            .await;
        jobs.jobs
    }

    /// Every run of `ci/<repo>`, newest first.
    pub async fn runs(&self, repo: &str) -> Vec<Run> {
        let runs: Runs = self
            .get_json(&format!("repos/{ADMIN}/{repo}/actions/runs"))
            .await;
        runs.workflow_runs
    }

    /// The job's log as Gitea serves it for download.
    pub async fn job_log(&self, repo: &str, job: i64) -> String {
        let path = format!("repos/{ADMIN}/{repo}/actions/jobs/{job}/logs");
        self.job_log_so_far(repo, job)
            .await
            .unwrap_or_else(|| panic!("GET {path}: 404, logs not found"))
    }

    /// The job's log so far; `None` while Gitea has none (`404`, before its first row).
    pub async fn job_log_so_far(&self, repo: &str, job: i64) -> Option<String> {
        let path = format!("repos/{ADMIN}/{repo}/actions/jobs/{job}/logs");
        let answer = self
            .http
            .get(self.api(&path))
            .header("authorization", format!("token {}", self.token))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        let status = answer.status();
        let body = answer.text().await.unwrap_or_default();
        if status == reqwest::StatusCode::NOT_FOUND {
            return None;
        }
        assert!(status.is_success(), "GET {path}: {status}: {body}");
        Some(body)
    }

    /// Waits until `ci/<repo>` has `count` jobs and every one of them is completed, and
    /// returns them; a hang fails with the jobs as they are and `context` (the
    /// controller's log, say).
    pub async fn completed_jobs(
        &self,
        repo: &str,
        count: usize,
        wait: Duration,
        context: impl Fn() -> String,
    ) -> Vec<Job> {
        let end = tokio::time::Instant::now() + wait;
        loop {
            let jobs = self.jobs(repo).await;
            if jobs.len() == count && jobs.iter().all(Job::is_completed) {
                return jobs;
            }
            assert!(
                tokio::time::Instant::now() < end,
                "{repo}: the jobs did not all complete within {wait:?}: {jobs:#?}\n{}",
                context()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Cancels the run as a user does: signed in to the web UI, `Cancel` on the run.
    pub async fn cancel_run(&self, repo: &str, run: i64) {
        let web = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_else(|e| panic!("an HTTP client: {e}"));
        let login = self
            .url
            .join("user/login")
            .unwrap_or_else(|e| panic!("{e}"));
        let answer = web
            .post(login)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(
                url::form_urlencoded::Serializer::new(String::new())
                    .append_pair("user_name", ADMIN)
                    .append_pair("password", ADMIN_PASSWORD)
                    .finish(),
            )
            .send()
            .await
            .unwrap_or_else(|e| panic!("signing in: {e}"));
        // The sign-in renews the session: of two `i_like_gitea` cookies the last one is
        // the signed-in session, so a later value of a name replaces an earlier one.
        let mut jar = std::collections::BTreeMap::new();
        for pair in answer
            .headers()
            .get_all("set-cookie")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .filter_map(|v| v.split(';').next()?.split_once('='))
        {
            jar.insert(pair.0.to_owned(), pair.1.to_owned());
        }
        let cookies: Vec<String> = jar.iter().map(|(k, v)| format!("{k}={v}")).collect();
        assert!(
            answer.status().is_redirection() && !cookies.is_empty(),
            "signing in to the web UI: {} {cookies:?}",
            answer.status()
        );
        let cancel = self
            .url
            .join(&format!("{ADMIN}/{repo}/actions/runs/{run}/cancel"))
            .unwrap_or_else(|e| panic!("{e}"));
        let answer = web
            .post(cancel)
            .header("cookie", cookies.join("; "))
            .send()
            .await
            .unwrap_or_else(|e| panic!("cancelling run {run}: {e}"));
        let status = answer.status();
        assert!(
            status.is_success() || status.is_redirection(),
            "cancelling run {run}: {status}: {}",
            answer.text().await.unwrap_or_default()
        );
    }

    /// The programs this Gitea was started from.
    pub fn peers(&self) -> &Peers {
        &self.peers
    }
}

fn app_ini(dir: &Path, static_root: &Path, port: u16, options: &GiteaOptions) -> String {
    let dir = dir.display();
    let mut ini = format!(
        "APP_NAME = gdr-test\nRUN_MODE = prod\nWORK_PATH = {dir}\n\
         I_AM_BEING_UNSAFE_RUNNING_AS_ROOT = true\n\n\
         [server]\nPROTOCOL = http\nHTTP_ADDR = 127.0.0.1\nHTTP_PORT = {port}\n\
         ROOT_URL = http://127.0.0.1:{port}/\nSTATIC_ROOT_PATH = {static_root}\n\
         APP_DATA_PATH = {dir}/data\nDISABLE_SSH = true\nOFFLINE_MODE = true\n\
         LFS_START_SERVER = false\n\n\
         [database]\nDB_TYPE = sqlite3\nPATH = {dir}/data/gitea.db\n\n\
         [security]\nINSTALL_LOCK = true\n\n\
         [service]\nDISABLE_REGISTRATION = true\n\n\
         [repository]\nROOT = {dir}/repos\n\n\
         [actions]\nENABLED = true\nDEFAULT_ACTIONS_URL = self\n",
        static_root = static_root.display(),
    );
    if let Some(timeout) = options.zombie_task_timeout {
        ini.push_str(&format!(
            "ZOMBIE_TASK_TIMEOUT = {}s\n\n[cron.stop_zombie_tasks]\nENABLED = true\n\
             RUN_AT_START = true\nSCHEDULE = @every 1s\n",
            timeout.as_secs().max(1)
        ));
    }
    // Each request of a test's polling would be a line: the router's log is off.
    ini.push_str("\n[log]\nMODE = console\nLEVEL = info\nlogger.router.MODE =\n");
    ini
}

/// Runs a `gitea` sub-command against the fixture's app.ini and returns its output.
async fn gitea(peers: &Peers, dir: &Path, args: &[&str]) -> String {
    let ini = dir.join("app.ini");
    let out = tokio::process::Command::new(&peers.gitea)
        .args(args)
        .arg("--config")
        .arg(&ini)
        .env("HOME", dir)
        .env("GITEA_WORK_DIR", dir)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", peers.gitea.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "gitea {args:?} failed: {text}");
    text
}

/// Starts `gitea web` on `port`, and on a fresh port again while the one it got was taken
/// meanwhile; returns the server once it answers `/api/v1/version`, and its port.
async fn serve(
    peers: &Peers,
    dir: &Path,
    mut port: u16,
    registration_token: &str,
) -> (tokio::process::Child, u16) {
    let ini = dir.join("app.ini");
    let log = dir.join("gitea.log");
    let home = dir.display().to_string();
    for _ in 0..5 {
        let mut server = tokio::process::Command::new(&peers.gitea)
            .arg("web")
            .arg("--config")
            .arg(&ini)
            .env("HOME", &home)
            .env("GITEA_WORK_DIR", &home)
            .env("GITEA_RUNNER_REGISTRATION_TOKEN", registration_token)
            .stdin(Stdio::null())
            .stdout(append(&log))
            .stderr(append(&log))
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", peers.gitea.display()));
        if answers(&mut server, port).await {
            return (server, port);
        }
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            text.contains("address already in use"),
            "gitea web exited at start:\n{text}"
        );
        let next = free_port();
        let config = std::fs::read_to_string(&ini)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", ini.display()))
            .replace(&format!(":{port}"), &format!(":{next}"))
            .replace(
                &format!("HTTP_PORT = {port}"),
                &format!("HTTP_PORT = {next}"),
            );
        std::fs::write(&ini, config)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", ini.display()));
        port = next;
    }
    panic!("gitea web found no free port in 5 attempts");
}

/// Waits until Gitea answers on `port` (true) or exits (false).
async fn answers(server: &mut tokio::process::Child, port: u16) -> bool {
    let version = loopback_url(port)
        .join("api/v1/version")
        .unwrap_or_else(|e| panic!("{e}"));
    let end = tokio::time::Instant::now() + START;
    while tokio::time::Instant::now() < end {
        if server.try_wait().ok().flatten().is_some() {
            return false;
        }
        if let Ok(answer) = reqwest::get(version.clone()).await
            && answer.status().is_success()
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("gitea web did not answer on port {port} within {START:?}");
}

fn append(path: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()))
}

fn free_port() -> u16 {
    listener()
        .local_addr()
        .unwrap_or_else(|e| panic!("a loopback listener has no address: {e}"))
        .port()
}

fn loopback_url(port: u16) -> url::Url {
    format!("http://127.0.0.1:{port}/")
        .parse()
        .unwrap_or_else(|e| panic!("a loopback URL: {e}"))
}

async fn git(work: &Path, home: &Path, args: &[&str]) {
    let out = tokio::process::Command::new("git")
        .args(["-c", "user.name=ci", "-c", "user.email=ci@example.invalid"])
        .args(args)
        .current_dir(work)
        .env("HOME", home)
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run git: {e}"));
    assert!(
        out.status.success(),
        "git {}: {}{}",
        args.first().unwrap_or(&""),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A registration token: Gitea takes one of at least 32 characters from its environment.
fn registration_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}
