//! `gitea-dynamic-runner`: parses the command line and runs one subcommand. Everything
//! else lives in the crates under `crates/` (see ARCHITECTURE.md); this file only binds
//! the listeners and turns signals into the one shutdown.

use std::process::ExitCode;

use gdr_controller::cli::{self, Cli, Command, ConfigArgs, ControllerArgs};
use gdr_controller::runtime::{self, Listeners};
use gdr_controller::shutdown::{Shutdown, shutdown_channel};
use gdr_executor::oneshot::{self, ExecutorConfig, Forward};

fn main() -> ExitCode {
    let cli = Cli::parse_args();
    // One crypto provider for every TLS configuration in the process.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    gdr_controller::logging::init();
    match cli.command {
        Command::Version => {
            println!("gitea-dynamic-runner {}", gdr_controller::VERSION);
            ExitCode::SUCCESS
        }
        Command::CheckConfig(args) => cli::check_config(args),
        Command::Register(args) => cli::register(args),
        Command::Status(args) => cli::status(&args),
        Command::Metrics(args) => cli::metrics(&args),
        Command::Controller(args) => controller(&args),
        Command::Executor => executor(),
        Command::ExecBoundToParent(args) => cli::exec_bound_to_parent(args),
        Command::SandboxIdentity(args) => sandbox_identity(&args),
    }
}

fn controller(args: &ControllerArgs) -> ExitCode {
    let settings = match cli::controller_settings(args) {
        Ok(s) => s,
        Err(code) => return code,
    };
    block_on(async move {
        let facade_addr = settings.scheduler.as_ref().map_or_else(
            // No scheduler, no facade: an ephemeral loopback port nothing dials.
            || "127.0.0.1:0".to_owned(),
            |s| s.facade.listen.clone(),
        );
        let mut inherited = listenfd::ListenFd::from_env();
        let listeners = Listeners {
            facade: listen(
                &mut inherited,
                "facade:health",
                ("facade", "runner_facade_listen"),
                &facade_addr,
            )
            .await?,
            health: listen(
                &mut inherited,
                "facade:health",
                ("health", "health_listen"),
                &settings.health_listen,
            )
            .await?,
        };
        runtime::run(settings, listeners, signalled())
            .await
            .map_err(|e| e.to_string())
    })
}

fn sandbox_identity(args: &ConfigArgs) -> ExitCode {
    let settings = match cli::sandbox_identity_settings(args) {
        Ok(s) => s,
        Err(code) => return code,
    };
    block_on(async move {
        let mut inherited = listenfd::ListenFd::from_env();
        let health = listen(
            &mut inherited,
            "health",
            ("health", "health_listen"),
            &settings.health_listen,
        )
        .await?;
        runtime::sandbox_identity::run(settings, health, signalled())
            .await
            .map_err(|e| e.to_string())
    })
}

/// Runs `work` on a new tokio runtime; an error is printed and fails.
fn block_on(work: impl Future<Output = Result<(), String>>) -> ExitCode {
    match tokio::runtime::Runtime::new().map(|tokio| tokio.block_on(work)) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => cli::fail(e),
        Err(e) => cli::fail(e),
    }
}

/// The listener named `name` handed over by socket activation (`LISTEN_FDS`, named by
/// `LISTEN_FDNAMES`, else by `default_names`), or a new one bound on `addr`, which the
/// configuration key `key` set (a failure names it, its variable and the value).
async fn listen(
    inherited: &mut listenfd::ListenFd,
    default_names: &str,
    (name, key): (&str, &str),
    addr: &str,
) -> Result<tokio::net::TcpListener, String> {
    let names = std::env::var("LISTEN_FDNAMES").unwrap_or_else(|_| default_names.into());
    if let Some(index) = names.split(':').position(|n| n == name)
        && let Some(std) = inherited
            .take_tcp_listener(index)
            .map_err(|e| format!("{name}: the inherited socket {index} is unusable: {e}"))?
    {
        std.set_nonblocking(true)
            .map_err(|e| format!("{name}: {e}"))?;
        return tokio::net::TcpListener::from_std(std).map_err(|e| format!("{name}: {e}"));
    }
    tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        format!(
            "{name}: cannot listen on {addr:?} ({key}, environment variable {}): {e}",
            key.to_ascii_uppercase()
        )
    })
}

fn executor() -> ExitCode {
    use gdr_executor::jobenv::{self, Start};
    let get = |name: &str| std::env::var(name).ok();
    // The Pod's `dockerd` container runs this program too, with no assignment.
    match jobenv::daemon_mode(jobenv::running_as_root(), get) {
        Ok(Some(daemon)) => return dockerd_container(daemon),
        Ok(None) => {}
        Err(e) => return cli::fail(e),
    }
    // The executor a root executor started takes the runner's identity first, while the
    // process has one thread.
    if let Err(e) = jobenv::take_identity(get) {
        return cli::fail(e);
    }
    let config = match ExecutorConfig::from_env(get) {
        Ok(c) => c,
        Err(e) => return cli::fail(e),
    };
    let start = match jobenv::start_mode(jobenv::running_as_root(), get) {
        Ok(s) => s,
        Err(e) => return cli::fail(e),
    };
    // One thread: the executor is a proxy next to one runner, and a single-threaded
    // runtime keeps its memory small (no per-thread allocator arenas).
    let tokio = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return cli::fail(e),
    };
    let status = match start {
        Start::Root(root) => {
            let program = match std::env::current_exe() {
                Ok(p) => p,
                Err(e) => return cli::fail(e),
            };
            tokio
                .block_on(async { jobenv::run_as_root(root, &program, forwarded_signals()).await })
                .map_err(|e| e.to_string())
        }
        Start::AsIs => tokio
            .block_on(async { oneshot::run(config, forwarded_signals()).await })
            .map_err(|e| e.to_string()),
    };
    match status {
        // The runner's own exit status; it does not reflect the job result.
        Ok(status) => ExitCode::from(u8::try_from(status.code().unwrap_or(1)).unwrap_or(1)),
        Err(e) => cli::fail(e),
    }
}

/// A privileged Pod's `dockerd` sidecar (`CI_EXECUTOR_DOCKERD_ONLY`).
fn dockerd_container(config: gdr_executor::jobenv::DaemonConfig) -> ExitCode {
    use gdr_executor::jobenv;
    let tokio = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return cli::fail(e),
    };
    let ran = tokio.block_on(async {
        let mut signals = forwarded_signals();
        jobenv::run_daemon(config, &jobenv::Paths::system(), &mut signals).await
    });
    match ran {
        Ok(status) => ExitCode::from(u8::try_from(status.code().unwrap_or(1)).unwrap_or(1)),
        Err(e) => cli::fail(e),
    }
}

/// SIGTERM and SIGINT, for the executor to pass on to its runner.
fn forwarded_signals() -> tokio::sync::mpsc::Receiver<Forward> {
    use tokio::signal::unix::{SignalKind, signal};
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    for (kind, forward) in [
        (SignalKind::terminate(), Forward::Terminate),
        (SignalKind::interrupt(), Forward::Interrupt),
    ] {
        let tx = tx.clone();
        match signal(kind) {
            Ok(mut stream) => {
                tokio::spawn(async move {
                    while stream.recv().await.is_some() && tx.send(forward).await.is_ok() {}
                });
            }
            Err(e) => eprintln!("cannot watch {forward:?}: {e}"),
        }
    }
    rx
}

/// Triggers on SIGTERM or SIGINT: the controller then stops fetching and drains.
fn signalled() -> Shutdown {
    use tokio::signal::unix::{SignalKind, signal};
    let (trigger, shutdown) = shutdown_channel();
    tokio::spawn(async move {
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        eprintln!("shutdown requested");
        trigger.trigger();
    });
    shutdown
}
