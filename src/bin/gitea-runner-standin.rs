//! `gitea-runner-standin daemon --once`: a test stand-in for the official Gitea runner.
//! The logic and its script convention live in
//! `gitea_dynamic_runner::testkit::standin_runner`.

#[tokio::main]
async fn main() {
    // Logs go to stderr so a test harness can show them next to its own output.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .try_init();
    let code = gitea_dynamic_runner::testkit::standin_runner::main_with_args(
        std::env::args().skip(1).collect(),
    )
    .await;
    std::process::exit(code);
}
