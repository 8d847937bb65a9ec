//! The performance figures of docs/performance.md, each next to its reference, in one
//! table: per-job overhead against plain runners, idle load on Gitea, the scheduler's
//! handoff against raw JetStream, controller and executor memory, and the facade's
//! latency and throughput against direct calls; and, with the real Gitea and official
//! runner built from their Go modules, the burst against plain official runners.
//!
//! `NATS_SERVER_BIN=… cargo bench --features testkit --bench perf` (plain `main`, no
//! harness). `--profile dev` gives a quick run with unoptimised figures.
//!
//! Both sides of every comparison run on this machine at the same time of the run: the
//! same mock Gitea, the same stand-in runner binary (a fresh process per job on both
//! sides), the same nats-server.

// A panic is how a benchmark fails. A measurement is a scenario read top to bottom, like a
// test: the length limit on functions is for product code.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::too_many_lines)]

mod chain;
mod facade;
mod handoff;
mod official;
mod table;

use table::Table;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wanted = |part: &str| only.is_empty() || only.iter().any(|o| o == part);
    let mut table = Table::default();
    if wanted("chain") {
        chain::run(&mut table).await;
    }
    if wanted("burst") {
        chain::run_burst(&mut table).await;
    }
    if wanted("handoff") {
        handoff::run(&mut table).await;
    }
    if wanted("facade") {
        facade::run(&mut table).await;
    }
    if wanted("official") {
        official::run(&mut table).await;
    }
    println!();
    print!("{}", table.markdown());
}
