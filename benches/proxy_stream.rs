//! Peak memory while 50 MiB stream from "Gitea" (a plain HTTP upstream) through the
//! facade's reverse proxy (the real facade app behind SPIFFE mTLS) and the executor's
//! loopback proxy to a client: the whole download path of a checkout.
//!
//! Run: `cargo bench --bench proxy_stream` (or `--profile dev` for a quick figure).
//! Prints the process's `VmHWM` (peak resident set, from `/proc/self/status`) before
//! and after the transfer; a proxy that buffered the body would add ≥ 50 MiB.

// A panic is how a test (or a benchmark harness) fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use gdr_controller::dispatch::Dispatch;
use gdr_controller::facade::Facade;
use gdr_controller::facade::proxy::ReverseProxy;
use gdr_controller::facade::tls::serve_tls;
use gdr_controller::gitea::{ClientOptions, GiteaClient};
use gdr_core::backend::Backend;
use gdr_core::capability::CapabilityKey;
use gdr_core::executor::ExecutorBackend;
use gdr_executor::proxy::serve_loopback_proxy;
use gdr_executor::relay::Relay;
use gdr_identity::tls::{executor_client_config, facade_server_config, x509_source};
use gdr_testkit::memory_backend::MemoryBackend;
use gdr_testkit::spiffe::{FakeWorkloadApi, TestCa};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;

const TOTAL: u64 = 50 * 1024 * 1024;
const CHUNK: u64 = 64 * 1024;
const FACADE_ID: &str = "spiffe://bench.test/facade";
const EXECUTOR_ID: &str = "spiffe://bench.test/executor";

/// Peak resident set size in KiB.
fn vm_hwm_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn Error>> {
    let dir = tempfile::tempdir()?;
    let ca = TestCa::new("bench.test")?;
    let facade_api = FakeWorkloadApi::start(dir.path(), ca.clone(), FACADE_ID).await?;
    let executor_api = FakeWorkloadApi::start(dir.path(), ca, EXECUTOR_ID).await?;
    let facade = x509_source(&facade_api.endpoint()).await?;
    let executor = x509_source(&executor_api.endpoint()).await?;

    // Upstream: an mTLS server streaming TOTAL bytes in 64 KiB chunks.
    let app = axum::Router::new()
        .route("/small", axum::routing::get(|| async { "ok" }))
        .route(
            "/blob",
            axum::routing::get(|| async {
                let chunks = futures::stream::unfold(0u64, |sent| async move {
                    (sent < TOTAL).then(|| {
                        let len = (TOTAL - sent).min(CHUNK);
                        let chunk = Bytes::from(vec![0xa5u8; len as usize]);
                        (Ok::<_, std::io::Error>(chunk), sent + len)
                    })
                });
                axum::body::Body::from_stream(chunks)
            }),
        );
    // Upstream: plain HTTP, as Gitea behind the facade.
    let upstream = TcpListener::bind("127.0.0.1:0").await?;
    let upstream_addr = upstream.local_addr()?;
    tokio::spawn(async move { axum::serve(upstream, app).await });
    let gitea_url = format!("http://{upstream_addr}");

    // The real facade application (RunnerService + reverse proxy) behind SPIFFE mTLS.
    let backend: Arc<dyn ExecutorBackend> = Arc::new(MemoryBackend::new(Backend::Pod));
    let dispatch = Arc::new(Dispatch::new(
        [(backend, 1)],
        CapabilityKey::new(&[7u8; 32])?,
    ));
    let gitea = GiteaClient::new(ClientOptions::new(gitea_url.clone()), None)?;
    let facade_app = Arc::new(Facade::new(dispatch, gitea, None, Default::default()))
        .app(ReverseProxy::new(&gitea_url, None)?);
    let facade_listener = TcpListener::bind("127.0.0.1:0").await?;
    let facade_addr = facade_listener.local_addr()?;
    let server_config = Arc::new(facade_server_config(&facade, "bench.test")?);
    tokio::spawn(serve_tls(
        facade_listener,
        server_config,
        facade_app,
        std::future::pending(),
    ));

    let proxy = TcpListener::bind("127.0.0.1:0").await?;
    let proxy_addr = proxy.local_addr()?;
    let client_config = executor_client_config(&executor, FACADE_ID)?;
    let relay = Relay::new(
        &format!("https://{facade_addr}"),
        &client_config,
        Duration::from_secs(30),
    )?;
    tokio::spawn(serve_loopback_proxy(proxy, relay, std::future::pending()));

    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    // Warm-up: one small request so connection set-up is not counted as streaming.
    let warm = client
        .get(format!("http://{proxy_addr}/small").parse()?)
        .await?;
    warm.into_body().collect().await?;
    let before = vm_hwm_kib().unwrap_or(0);
    let started = Instant::now();
    let resp = client
        .get(format!("http://{proxy_addr}/blob").parse()?)
        .await?;
    let mut body = resp.into_body();
    let mut total = 0u64;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            total += data.len() as u64;
        }
    }
    let elapsed = started.elapsed();
    let after = vm_hwm_kib().unwrap_or(0);
    if total != TOTAL {
        return Err(format!("received {total} of {TOTAL} bytes").into());
    }
    println!(
        "proxy_stream: {} MiB in {:.2?} ({:.0} MiB/s); VmHWM before {} KiB, after {} KiB, growth {} KiB",
        TOTAL / (1024 * 1024),
        elapsed,
        (TOTAL as f64 / (1024.0 * 1024.0)) / elapsed.as_secs_f64(),
        before,
        after,
        after.saturating_sub(before)
    );
    Ok(())
}
