//! Entry point: parses the CLI, installs logging and runs one subcommand.

use std::process::ExitCode;

use gdr_controller::cli::{self, Cli, Command};
use gdr_controller::config::Config;
use gdr_controller::logging;

fn main() -> ExitCode {
    let cli = Cli::parse_args();
    // Pick aws-lc-rs explicitly: if a second provider ever got linked in, rustls
    // could not choose one and would fail at the first TLS config.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    logging::init();
    match cli.command {
        Command::Version => {
            println!("gitea-dynamic-runner {}", gdr_controller::VERSION);
            ExitCode::SUCCESS
        }
        Command::CheckConfig(args) => cli::check_config(args),
        Command::Register(args) => cli::register(args),
        Command::Controller(args) => run_controller(args),
        Command::Executor => run_executor(),
        Command::SandboxIdentity => not_implemented("sandbox-identity"),
    }
}

fn not_implemented(what: &str) -> ExitCode {
    eprintln!("gitea-dynamic-runner {what}: not implemented yet");
    ExitCode::from(2)
}

fn run_controller(args: gdr_controller::cli::ConfigArgs) -> ExitCode {
    use gdr_controller::runtime;
    let config = match args.sources().and_then(|s| Config::load(&s)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("configuration error:\n{e}");
            return ExitCode::FAILURE;
        }
    };
    let tokio = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return cli::fail(e),
    };
    tokio.block_on(async move {
        let bind = |what: &'static str, addr: String| async move {
            tokio::net::TcpListener::bind(&addr)
                .await
                .map_err(|e| format!("{what}: cannot listen on {addr}: {e}"))
        };
        let listeners = match (
            bind("runner_facade_listen", config.runner_facade_listen.clone()).await,
            bind("health_listen", config.health_listen.clone()).await,
        ) {
            (Ok(facade), Ok(health)) => runtime::Listeners { facade, health },
            (Err(e), _) | (_, Err(e)) => return cli::fail(e),
        };
        match runtime::run(
            config,
            listeners,
            shutdown_signal(),
            runtime::Handles::default(),
        )
        .await
        {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => cli::fail(e),
        }
    })
}

/// Resolves on SIGTERM or SIGINT: the controller then stops fetching and drains.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
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
}

fn run_executor() -> ExitCode {
    use gdr_executor::oneshot;
    let config = match oneshot::ExecutorConfig::from_env(|name| std::env::var(name).ok()) {
        Ok(c) => c,
        Err(e) => return cli::fail(e),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return cli::fail(e),
    };
    match runtime.block_on(oneshot::run(config)) {
        // The runner's own exit status; it does not reflect the job result.
        Ok(status) => ExitCode::from(u8::try_from(status.code().unwrap_or(1)).unwrap_or(1)),
        Err(e) => cli::fail(e),
    }
}
