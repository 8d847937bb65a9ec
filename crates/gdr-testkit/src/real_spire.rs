//! The real SPIRE on loopback: `spire-server` and `spire-agent` built from their Go module by
//! `tests/spire-peers/build.sh` (found through `SPIRE_SERVER_BIN` and `SPIRE_AGENT_BIN`,
//! which `.ci/run` exports). The server keeps its datastore in SQLite under a temporary
//! directory and attests its one agent with a join token; the agent attests workloads with
//! the `unix` plugin, so a test's registration entries select processes by uid.
//!
//! What this exercises is SPIRE's own Workload API (X.509 and JWT SVIDs, bundles, rotation)
//! and its CLI; it is not the Kubernetes workload attestor nor the SPIFFE CSI driver, which
//! need a kubelet and a node.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::controller::listener;

/// Trust domain of the fixture's SPIRE.
pub const TRUST_DOMAIN: &str = "example.org";
/// The SPIFFE ID of the fixture's node (the parent of every entry).
pub const NODE_ID: &str = "spiffe://example.org/host";
/// The server's and the agent's start-up (key generation, a fresh SQLite datastore, node
/// attestation) take about a second; only a bound on a hang.
const START: Duration = Duration::from_secs(60);

/// Why the fixture could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum SpireError {
    /// A file of the fixture could not be written or a program not started.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A SPIRE command failed.
    #[error("`{command}` failed: {output}")]
    Command {
        /// The command line.
        command: String,
        /// Its standard output and error.
        output: String,
    },
    /// A server or agent did not become healthy in time.
    #[error("{0} did not become healthy within {START:?}")]
    Unhealthy(&'static str),
}

pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SpireError {
    let what = what.into();
    move |source| SpireError::Io { what, source }
}

/// The SPIRE programs, from the environment `.ci/run` sets from `tests/spire-peers/build.sh`.
#[derive(Clone, Debug)]
pub struct SpirePrograms {
    /// `spire-server`.
    pub server: PathBuf,
    /// `spire-agent` (also the CLI a job runs: `spire-agent api fetch jwt`).
    pub agent: PathBuf,
}

impl SpirePrograms {
    /// The programs named by `SPIRE_SERVER_BIN` and `SPIRE_AGENT_BIN`; a test without them
    /// fails saying how to build them (it never passes without its peer).
    pub fn from_env() -> SpirePrograms {
        let var = |name: &str| {
            crate::peer_path(
                name,
                "the real-SPIRE tests need SPIRE built from its Go module",
                "tests/spire-peers/build.sh",
            )
        };
        SpirePrograms {
            server: var("SPIRE_SERVER_BIN"),
            agent: var("SPIRE_AGENT_BIN"),
        }
    }
}

/// A registration entry as the SPIRE server holds it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Entry {
    /// Its SPIFFE ID.
    pub spiffe_id: String,
    /// The SPIFFE ID of the agent (or node alias) it is issued under.
    pub parent_id: String,
    /// Its selectors as `type:value`, sorted.
    pub selectors: Vec<String>,
}

impl Entry {
    /// An entry of the server API's JSON (IDs as trust domain and path).
    fn from_json(entry: &serde_json::Value) -> Option<Entry> {
        let id = |v: &serde_json::Value| {
            Some(format!(
                "spiffe://{}{}",
                v["trust_domain"].as_str()?,
                v["path"].as_str()?
            ))
        };
        let mut selectors: Vec<String> = entry["selectors"]
            .as_array()?
            .iter()
            .map(|s| {
                format!(
                    "{}:{}",
                    s["type"].as_str().unwrap_or(""),
                    s["value"].as_str().unwrap_or("")
                )
            })
            .collect();
        selectors.sort();
        Some(Entry {
            spiffe_id: id(&entry["spiffe_id"])?,
            parent_id: id(&entry["parent_id"])?,
            selectors,
        })
    }
}

/// A SPIRE server and one agent, both killed when dropped.
pub struct RealSpire {
    programs: SpirePrograms,
    dir: tempfile::TempDir,
    _server: tokio::process::Child,
    _agent: tokio::process::Child,
}

impl RealSpire {
    /// Starts the server, attests an agent with a join token and waits until both are healthy.
    pub async fn start(programs: SpirePrograms) -> Result<RealSpire, SpireError> {
        // Short: a Unix socket path must stay under 108 bytes.
        let dir = tempfile::Builder::new()
            .prefix("sp")
            .tempdir_in("/tmp")
            .map_err(io("creating the SPIRE directory"))?;
        let root = dir.path();
        for sub in ["server", "agent", "public"] {
            std::fs::create_dir(root.join(sub)).map_err(io(format!("creating {sub}/")))?;
        }
        // Workloads of other uids reach the agent's socket in public/; the server's and the
        // agent's keys stay in their own 0700 directories.
        for reachable in [root, &root.join("public")] {
            std::fs::set_permissions(reachable, std::fs::Permissions::from_mode(0o755))
                .map_err(io(format!("opening {}", reachable.display())))?;
        }
        let port = listener()
            .local_addr()
            .map_err(io("picking a port"))?
            .port();
        write(&root.join("server.conf"), &server_config(root, port))?;
        let server = spawn(
            &programs.server,
            root,
            "server",
            &["run", "-config"],
            "server.conf",
        )?;
        let server_socket = root.join("server/api.sock");
        healthy(&programs.server, &server_socket, "spire-server").await?;
        let bundle = run(
            &programs.server,
            &["bundle", "show", "-socketPath", path(&server_socket)],
        )
        .await?;
        write(&root.join("bundle.pem"), &bundle)?;
        let token = run(
            &programs.server,
            &[
                "token",
                "generate",
                "-socketPath",
                path(&server_socket),
                "-spiffeID",
                NODE_ID,
            ],
        )
        .await?;
        let token = token
            .lines()
            .find_map(|l| l.strip_prefix("Token: "))
            .map(str::trim)
            .ok_or_else(|| SpireError::Command {
                command: "spire-server token generate".into(),
                output: token.clone(),
            })?
            .to_owned();
        write(&root.join("agent.conf"), &agent_config(root, port))?;
        let agent = spawn(
            &programs.agent,
            root,
            "agent",
            &["run", "-joinToken", &token, "-config"],
            "agent.conf",
        )?;
        healthy(
            &programs.agent,
            &root.join("public/api.sock"),
            "spire-agent",
        )
        .await?;
        // The CLI a job runs, where workloads of any uid can execute it (the build cache
        // may live under a 0700 home directory), as an executor image would carry it.
        let cli = root.join("public/spire-agent");
        std::fs::copy(&programs.agent, &cli).map_err(io("copying the spire-agent CLI"))?;
        let programs = SpirePrograms {
            agent: cli,
            ..programs
        };
        Ok(RealSpire {
            programs,
            dir,
            _server: server,
            _agent: agent,
        })
    }

    /// The agent's Workload API socket.
    pub fn agent_socket(&self) -> PathBuf {
        self.dir.path().join("public/api.sock")
    }

    /// The agent's Workload API as `SPIFFE_ENDPOINT_SOCKET` names it.
    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.agent_socket().display())
    }

    /// The `spire-agent` program (the CLI a job runs), executable by every uid.
    pub fn agent_program(&self) -> &Path {
        &self.programs.agent
    }

    /// Registers `spiffe_id` for the processes of `uid` (`spire-server entry create`, under
    /// the fixture's node). The agent learns of it at its next sync (every few seconds).
    pub async fn register_uid(&self, spiffe_id: &str, uid: u32) -> Result<(), SpireError> {
        let selector = format!("unix:uid:{uid}");
        let socket = self.server_socket();
        run(
            &self.programs.server,
            &[
                "entry",
                "create",
                "-socketPath",
                path(&socket),
                "-parentID",
                NODE_ID,
                "-spiffeID",
                spiffe_id,
                "-selector",
                &selector,
            ],
        )
        .await
        .map(drop)
    }

    /// Waits until the agent issues `spiffe_id` to a process of `uid` (what the Workload API
    /// answers `spire-agent api fetch x509` run as that uid): the agent learns of new
    /// entries at its next sync with the server.
    pub async fn wait_until_issued(&self, uid: u32, spiffe_id: &str) -> Result<(), SpireError> {
        let end = tokio::time::Instant::now() + START;
        let socket = self.agent_socket();
        while tokio::time::Instant::now() < end {
            let out = tokio::process::Command::new(&self.programs.agent)
                .args(["api", "fetch", "x509", "-socketPath", path(&socket)])
                .uid(uid)
                .stdin(Stdio::null())
                .output()
                .await
                .map_err(io("running spire-agent api fetch x509"))?;
            if out.status.success() && String::from_utf8_lossy(&out.stdout).contains(spiffe_id) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Err(SpireError::Command {
            command: format!("spire-agent api fetch x509 as uid {uid}"),
            output: format!("{spiffe_id} was not issued within {START:?}"),
        })
    }

    /// The server's API socket (the `spire-server` CLI's and spire-controller-manager's).
    pub fn server_socket(&self) -> PathBuf {
        self.dir.path().join("server/api.sock")
    }

    /// The server's registration entries (`spire-server entry show -output json`).
    pub async fn entries(&self) -> Result<Vec<Entry>, SpireError> {
        let socket = self.server_socket();
        let command = "spire-server entry show -output json";
        let out = run(
            &self.programs.server,
            &[
                "entry",
                "show",
                "-socketPath",
                path(&socket),
                "-output",
                "json",
            ],
        )
        .await?;
        let bad = |what: &str| SpireError::Command {
            command: command.into(),
            output: format!("{what} in: {out}"),
        };
        let doc: serde_json::Value = serde_json::from_str(&out).map_err(|_| bad("no JSON"))?;
        let entries = doc["entries"].as_array().cloned().unwrap_or_default();
        entries
            .iter()
            .map(|e| Entry::from_json(e).ok_or_else(|| bad("an entry without IDs")))
            .collect()
    }

    /// The server's and the agent's logs, for a failing test's message.
    pub fn logs(&self) -> String {
        ["server.log", "agent.log"]
            .iter()
            .map(|name| {
                let text = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
                format!("== {name}\n{text}")
            })
            .collect()
    }
}

fn server_config(root: &Path, port: u16) -> String {
    let root = root.display();
    format!(
        r#"server {{
  bind_address = "127.0.0.1"
  bind_port = "{port}"
  socket_path = "{root}/server/api.sock"
  trust_domain = "{TRUST_DOMAIN}"
  data_dir = "{root}/server"
  log_level = "DEBUG"
}}
plugins {{
  DataStore "sql" {{
    plugin_data {{
      database_type = "sqlite3"
      connection_string = "{root}/server/datastore.sqlite3"
    }}
  }}
  NodeAttestor "join_token" {{
    plugin_data {{}}
  }}
  KeyManager "memory" {{
    plugin_data {{}}
  }}
}}
"#
    )
}

fn agent_config(root: &Path, port: u16) -> String {
    let root = root.display();
    format!(
        r#"agent {{
  data_dir = "{root}/agent"
  server_address = "127.0.0.1"
  server_port = "{port}"
  socket_path = "{root}/public/api.sock"
  trust_domain = "{TRUST_DOMAIN}"
  trust_bundle_path = "{root}/bundle.pem"
  log_level = "DEBUG"
}}
plugins {{
  NodeAttestor "join_token" {{
    plugin_data {{}}
  }}
  KeyManager "disk" {{
    plugin_data {{
      directory = "{root}/agent"
    }}
  }}
  WorkloadAttestor "unix" {{
    plugin_data {{}}
  }}
}}
"#
    )
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap_or_default()
}

fn write(path: &Path, text: &str) -> Result<(), SpireError> {
    std::fs::write(path, text).map_err(io(format!("writing {}", path.display())))
}

/// Starts `program args… <root>/<config>` with its output in `<root>/<name>.log`, in a
/// process group of its own, killed with the fixture.
fn spawn(
    program: &Path,
    root: &Path,
    name: &str,
    args: &[&str],
    config: &str,
) -> Result<tokio::process::Child, SpireError> {
    let log = std::fs::File::create(root.join(format!("{name}.log")))
        .map_err(io(format!("creating {name}.log")))?;
    let err = log.try_clone().map_err(io("duplicating a log"))?;
    tokio::process::Command::new(program)
        .args(args)
        .arg(root.join(config))
        .current_dir(root)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(io(format!("starting {}", program.display())))
}

/// Runs a SPIRE CLI command; its standard output, or an error with everything it said.
async fn run(program: &Path, args: &[&str]) -> Result<String, SpireError> {
    let out = tokio::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(io(format!("running {}", program.display())))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        return Ok(stdout);
    }
    Err(SpireError::Command {
        command: format!("{} {}", program.display(), args.join(" ")),
        output: format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)),
    })
}

/// Waits for `<program> healthcheck -socketPath <socket>` to succeed.
async fn healthy(program: &Path, socket: &Path, what: &'static str) -> Result<(), SpireError> {
    let end = tokio::time::Instant::now() + START;
    while tokio::time::Instant::now() < end {
        if run(program, &["healthcheck", "-socketPath", path(socket)])
            .await
            .is_ok()
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(SpireError::Unhealthy(what))
}
