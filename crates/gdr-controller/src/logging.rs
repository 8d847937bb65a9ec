//! Structured logs: JSON lines on stderr, level filter from the environment.
//!
//! Secrets never reach a log line: tokens, capabilities and task payloads live in
//! types whose `Debug` redacts them, and nothing logs a request body.

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;

/// The level filter: `RUST_LOG`, else `LOG_LEVEL` (the Go version's name), else `info`.
pub fn env_filter() -> EnvFilter {
    if let Ok(filter) = EnvFilter::try_from_default_env() {
        return filter;
    }
    std::env::var("LOG_LEVEL")
        .ok()
        .and_then(|level| EnvFilter::try_new(level.to_ascii_lowercase()).ok())
        .unwrap_or_else(|| EnvFilter::new("info"))
}

/// A JSON subscriber writing to `writer`; `main` passes stderr, tests a buffer.
pub fn subscriber<W>(filter: EnvFilter, writer: W) -> impl tracing::Subscriber + Send + Sync
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    tracing_subscriber::registry().with(filter).with(
        tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_writer(writer),
    )
}

/// Installs the process-wide subscriber (stderr). Only `main` calls this.
pub fn init() {
    // A second init (e.g. in tests) keeps the first subscriber, which is fine.
    let _ = tracing::subscriber::set_global_default(subscriber(env_filter(), std::io::stderr));
}
