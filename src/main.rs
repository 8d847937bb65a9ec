//! `gitea-dynamic-runner`: parses the command line and runs one subcommand. Everything
//! else lives in the crates under `crates/` (see ARCHITECTURE.md); this file only binds
//! the listeners and turns signals into the one shutdown.

use std::process::ExitCode;

use gdr_controller::cli::{self, Cli, Command, ConfigArgs, ControllerArgs};
use gdr_controller::runtime::{self, Listeners};
use gdr_controller::shutdown::{Shutdown, shutdown_channel};

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
        // The alias of the `gitea-dynamic-executor` binary, for deployments and tests that
        // still start `gitea-dynamic-runner executor`.
        Command::Executor => gdr_executor::cli::run(),
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
