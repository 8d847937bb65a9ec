//! Standalone mock Gitea: the runner protocol under `/api/actions` plus a JSON admin API.
//!
//! ```text
//! cargo run --example mock-gitea -- --listen 127.0.0.1:3000 --registration-token abc
//! curl -X POST --data-binary @.gitea/workflows/ci.yaml 'http://127.0.0.1:3000/_mock/workflows?repo=me/app'
//! curl http://127.0.0.1:3000/_mock/jobs
//! ```

// A panic is how a test (or a benchmark harness) fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use gdr_testkit::mock_gitea::{MockConfig, MockGitea};
use rand::RngExt;

/// A mock Gitea speaking the Actions runner protocol (in memory, for local testing).
///
/// Admin API: POST /_mock/workflows?repo=owner/repo (YAML body) → job ids;
/// GET /_mock/jobs; POST /_mock/jobs/{id}/cancel; POST /_mock/registration-tokens (body = token);
/// GET /_mock/blob/{bytes}.
#[derive(Parser, Debug)]
#[command(name = "mock-gitea")]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// Accepted registration token (repeatable). Without one, a random token is created.
    #[arg(long = "registration-token")]
    registration_tokens: Vec<String>,
    /// Running tasks without an update for this long are failed, e.g. `10m`, `90s`, `30`.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    zombie_timeout: Duration,
    /// URL put into task contexts as `server_url` (default: http://<listen>/).
    #[arg(long)]
    public_url: Option<String>,
}

/// `<n>` seconds, or `<n>ms|s|m|h`.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 10m, 90s or 30"))?;
    let secs = |factor: u64| {
        n.checked_mul(factor)
            .map(Duration::from_secs)
            .ok_or_else(|| format!("{s:?} is too large"))
    };
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "" | "s" => secs(1),
        "m" => secs(60),
        "h" => secs(3600),
        other => Err(format!(
            "unknown duration unit {other:?} (use ms, s, m or h)"
        )),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();

    let mut tokens = args.registration_tokens;
    if tokens.is_empty() {
        let bytes: [u8; 20] = rand::rng().random();
        tokens.push(bytes.iter().map(|b| format!("{b:02x}")).collect());
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let addr = listener.local_addr()?;
    let config = MockConfig {
        zombie_timeout: args.zombie_timeout,
        public_url: args.public_url,
        registration_tokens: tokens.clone(),
        ..MockConfig::default()
    };

    // The banner goes to stdout for the person starting it; tracing output never carries
    // tokens.
    println!("mock Gitea listening on http://{addr}/");
    for t in &tokens {
        println!("registration token: {t}");
    }
    println!(
        "queue a workflow: curl -X POST --data-binary @workflow.yaml 'http://{addr}/_mock/workflows?repo=owner/repo'"
    );

    MockGitea::new(config)
        .serve(listener, async {
            if let Err(e) = tokio::signal::ctrl_c().await {
                tracing::error!(error = %e, "cannot wait for Ctrl-C; stopping");
            }
            tracing::info!("stopping");
        })
        .await
        .map_err(|e| format!("server failed: {e}"))?;
    Ok(())
}
