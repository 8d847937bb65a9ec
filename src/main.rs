//! Entry point: parses the CLI, installs logging and runs one subcommand.

use std::process::ExitCode;

use clap::Parser;
use gitea_dynamic_runner::cli::{Cli, Command};
use gitea_dynamic_runner::config::{Config, ConfigError};
use gitea_dynamic_runner::{logging, register};

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Pick aws-lc-rs explicitly: if a second provider ever got linked in, rustls
    // could not choose one and would fail at the first TLS config.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    logging::init();
    match cli.command {
        Command::Version => {
            println!("gitea-dynamic-runner {}", gitea_dynamic_runner::VERSION);
            ExitCode::SUCCESS
        }
        Command::CheckConfig(args) => check_config(args),
        Command::Register(args) => run_register(args),
        Command::Controller(args) => run_controller(args),
        Command::Executor => run_executor(),
        Command::SandboxIdentity => not_implemented("sandbox-identity"),
    }
}

fn not_implemented(what: &str) -> ExitCode {
    eprintln!("gitea-dynamic-runner {what}: not implemented yet");
    ExitCode::from(2)
}

fn check_config(args: gitea_dynamic_runner::cli::CheckConfigArgs) -> ExitCode {
    if args.reference {
        print!("{}", gitea_dynamic_runner::cli::reference());
        return ExitCode::SUCCESS;
    }
    let config = match args
        .config
        .sources()
        .and_then(|s| Config::load_unvalidated(&s))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("configuration error:\n{e}");
            return ExitCode::FAILURE;
        }
    };
    print!("{}", config.render());
    let mut problems: Vec<String> = config.problems().iter().map(ToString::to_string).collect();
    for (key, path) in config.secret_files() {
        if let Err(e) = gitea_dynamic_runner::config::read_secret_file(key, path) {
            problems.push(e.to_string());
        }
    }
    for plain in [
        "GITEA_RUNNER_TOKEN",
        "NATS_PRODUCER_PASSWORD",
        "NATS_WORKER_PASSWORD",
        "OPENSANDBOX_API_KEY",
        "RUNNER_FACADE_CAPABILITY_KEY",
    ] {
        if std::env::var_os(plain).is_some() {
            problems.push(format!(
                "{plain} is set but ignored: secrets are read only from files ({plain}_FILE)"
            ));
        }
    }
    if problems.is_empty() {
        eprintln!("configuration OK");
        ExitCode::SUCCESS
    } else {
        eprintln!("{} problem(s):", problems.len());
        for p in &problems {
            eprintln!("  - {p}");
        }
        ExitCode::FAILURE
    }
}

fn run_register(args: gitea_dynamic_runner::cli::RegisterArgs) -> ExitCode {
    let config = match args
        .config
        .sources()
        .and_then(|s| Config::load_unvalidated(&s))
    {
        Ok(c) => c,
        Err(ConfigError::Invalid(p)) => return fail(ConfigError::Invalid(p)),
        Err(e) => return fail(e),
    };
    let registration = match register::from_config(
        &config,
        &args.registration_token_file,
        args.name,
        args.labels,
        args.force,
    ) {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    match runtime.block_on(register::run(&registration)) {
        Ok(registered) => {
            print!("{}", register::next_steps(&registration, &registered));
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

fn run_controller(args: gitea_dynamic_runner::cli::ConfigArgs) -> ExitCode {
    use gitea_dynamic_runner::runtime;
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
        Err(e) => return fail(e),
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
            (Err(e), _) | (_, Err(e)) => return fail(e),
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
            Err(e) => fail(e),
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
    tracing::info!("shutdown requested");
}

fn run_executor() -> ExitCode {
    use gitea_dynamic_runner::executor::oneshot;
    let config = match oneshot::ExecutorConfig::from_env(|name| std::env::var(name).ok()) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    match runtime.block_on(oneshot::run(config)) {
        // The runner's own exit status; it does not reflect the job result.
        Ok(status) => ExitCode::from(u8::try_from(status.code().unwrap_or(1)).unwrap_or(1)),
        Err(e) => fail(e),
    }
}

fn fail(error: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {error}");
    ExitCode::FAILURE
}
