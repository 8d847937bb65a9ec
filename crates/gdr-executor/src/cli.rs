//! The executor's command line: what `gitea-dynamic-executor` runs (and the controller
//! binary's `executor` subcommand, its alias). Everything comes from the environment
//! (`CI_*`, `SPIFFE_ENDPOINT_SOCKET`); the only arguments are an optional `executor` (the
//! root executor starts itself again as the runner's user with it, and the backends'
//! `executor_args` default to it, so either binary takes the same command line) and
//! `version`.

use std::process::ExitCode;

use crate::oneshot::{self, ExecutorConfig, Forward};

/// The name of the executor's own binary, installed next to the controller's.
pub const BINARY: &str = "gitea-dynamic-executor";

/// `main` of `gitea-dynamic-executor`: sets up the process (crypto provider, JSON logs)
/// as the controller binary does, then runs the executor.
pub fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    match (args.next().as_deref(), args.next()) {
        (None | Some("executor"), None) => {}
        (Some("version" | "--version"), None) => {
            println!("{BINARY} {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!(
                "usage: {BINARY} [executor]\n(configured by the environment: see docs/executor.md)"
            );
            return ExitCode::from(2);
        }
    }
    // One crypto provider for every TLS configuration in the process.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    init_logging();
    run()
}

/// JSON lines on stderr, level from `RUST_LOG`, else `LOG_LEVEL`, else `info`: the same
/// format as the controller's `gdr_controller::logging`, which this crate cannot link
/// (the executor links no controller code), so an executor's log reads the same from
/// either binary.
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    use tracing_subscriber::layer::SubscriberExt;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        std::env::var("LOG_LEVEL")
            .ok()
            .and_then(|level| EnvFilter::try_new(level.to_ascii_lowercase()).ok())
            .unwrap_or_else(|| EnvFilter::new("info"))
    });
    let subscriber = tracing_subscriber::registry().with(filter).with(
        tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_writer(std::io::stderr),
    );
    let _ = tracing::subscriber::set_global_default(subscriber);
}

fn fail(error: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {error}");
    ExitCode::FAILURE
}

/// Runs the executor (or a Pod's `dockerd` container) from the environment; the process
/// is set up by the caller.
pub fn run() -> ExitCode {
    use crate::jobenv::{self, Start};
    let get = |name: &str| std::env::var(name).ok();
    // The Pod's `dockerd` container runs this program too, with no assignment.
    match jobenv::daemon_mode(jobenv::running_as_root(), get) {
        Ok(Some(daemon)) => return dockerd_container(daemon),
        Ok(None) => {}
        Err(e) => return fail(e),
    }
    // A warm Pod's executor has no assignment until a job claims its Pod.
    if let Some(dir) = get(crate::standby::STANDBY_DIR) {
        return fail(crate::standby::wait_then_exec(std::path::Path::new(&dir)));
    }
    // A warm VM sandbox's executor asks the facade for it once a job claimed its sandbox.
    if get(gdr_core::executor::env::STANDBY_ID).is_some() {
        return fail(crate::vm_standby::wait_then_exec(get));
    }
    // The executor a root executor started takes the runner's identity first, while the
    // process has one thread.
    if let Err(e) = jobenv::take_identity(get) {
        return fail(e);
    }
    let config = match ExecutorConfig::from_env(get) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let start = match jobenv::start_mode(jobenv::running_as_root(), get) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    // One thread: the executor is a proxy next to one runner, and a single-threaded
    // runtime keeps its memory small (no per-thread allocator arenas).
    let tokio = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    let status = match start {
        Start::Root(root) => {
            let program = match std::env::current_exe() {
                Ok(p) => p,
                Err(e) => return fail(e),
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
        Err(e) => fail(e),
    }
}

/// A privileged Pod's `dockerd` sidecar (`CI_EXECUTOR_DOCKERD_ONLY`).
fn dockerd_container(config: crate::jobenv::DaemonConfig) -> ExitCode {
    use crate::jobenv;
    let tokio = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    let ran = tokio.block_on(async {
        let mut signals = forwarded_signals();
        jobenv::run_daemon(config, &jobenv::Paths::system(), &mut signals).await
    });
    match ran {
        Ok(status) => ExitCode::from(u8::try_from(status.code().unwrap_or(1)).unwrap_or(1)),
        Err(e) => fail(e),
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
