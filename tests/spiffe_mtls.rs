//! The SPIFFE/mTLS layer against a fake Workload API (real gRPC over a Unix socket, real
//! `X509Source`, real rustls handshakes), the executor's loopback proxy, and the
//! stand-in runner against the mock Gitea.
//!
//! The stand-in runner tests (the last section) protect no product invariant: they keep the
//! stand-in faithful to the official runner (one task per `.runner`, log streaming and
//! archiving, results and exit statuses, cancellation by Gitea and by SIGTERM, a crash
//! without a final report, checkout through its address), so that the tests running it as an
//! executor's runner mean what they say. Each states the behaviour in a `Peer fidelity` line.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::routing::{get, post};
use axum::{Extension, Router};
use bytes::Bytes;
use gdr_executor::proxy::{RunnerCredentials, serve_loopback_proxy};
use gdr_executor::relay::Relay;
use gdr_facade::tls::serve_tls;
use gdr_identity::svid_stream::{SvidStream, executor_client_config, svid_stream};
use gdr_identity::tls::{PeerSpiffeId, facade_server_config, x509_source_with_timeout};
use gdr_proto::runner::v1 as pb;
use gdr_testkit::mock_gitea::{JobId, MockConfig, MockGitea, RunningMock, Status};
use gdr_testkit::spiffe::{
    FakeWorkloadApi, RunningWorkloadApi, TestCa, any_server_client_config, raw_tls_get,
};
use gdr_testkit::until;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::ServerName;
use spiffe::X509Source;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const TD: &str = "example.test";
const FACADE_ID: &str = "spiffe://example.test/ns/ci/sa/facade";
const EXECUTOR_ID: &str = "spiffe://example.test/ci/owner/repo/build";
const WAIT: Duration = Duration::from_secs(20);
/// The assignment the loopback proxies here speak for, and its capability.
const ASSIGNMENT: &str = "gitea-task-7";
const CAPABILITY: &str = "capability-of-gitea-task-7";
/// How long the loopback proxy waits out an unreachable facade in these tests.
const TOLERANCE: Duration = Duration::from_secs(1);

/// A trust domain with two workloads: the facade and one executor.
struct Pki {
    _dir: tempfile::TempDir,
    facade_api: RunningWorkloadApi,
    executor_api: RunningWorkloadApi,
    facade: Arc<X509Source>,
    executor: SvidStream,
}

async fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(TD).unwrap();
    let facade_api = FakeWorkloadApi::start(dir.path(), ca.clone(), FACADE_ID)
        .await
        .unwrap();
    let executor_api = FakeWorkloadApi::start(dir.path(), ca, EXECUTOR_ID)
        .await
        .unwrap();
    let facade = x509_source_with_timeout(&facade_api.endpoint(), WAIT)
        .await
        .unwrap();
    let executor = svid_stream(&executor_api.endpoint(), WAIT).await.unwrap();
    Pki {
        _dir: dir,
        facade_api,
        executor_api,
        facade,
        executor,
    }
}

/// An mTLS server in the background; dropping `stop` shuts it down.
struct TlsServer {
    addr: SocketAddr,
    _stop: gdr_controller::shutdown::ShutdownGuard,
}

async fn serve(config: rustls::ServerConfig, app: Router) -> TlsServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = gdr_controller::shutdown::shutdown_channel();
    let stop = stop.into_guard();
    tokio::spawn(serve_tls(listener, Arc::new(config), app, stopped));
    TlsServer { addr, _stop: stop }
}

type HttpsClient<B> = Client<hyper_rustls::HttpsConnector<HttpConnector>, B>;

fn https_client<B>(config: rustls::ClientConfig) -> HttpsClient<B>
where
    B: hyper::body::Body + Send + Unpin + 'static,
    B::Data: Send,
{
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only()
        .enable_all_versions()
        .wrap_connector(http);
    Client::builder(TokioExecutor::new()).build(https)
}

async fn get_text(
    client: &HttpsClient<Empty<Bytes>>,
    url: &str,
) -> Result<String, hyper_util::client::legacy::Error> {
    let resp = client.get(url.parse().unwrap()).await?;
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Ok(String::from_utf8(body.to_vec()).unwrap())
}

/// A facade-configured mTLS server running [`whoami_app`], with its hit counter.
async fn whoami_facade(pki: &Pki) -> (TlsServer, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let server = serve(
        facade_server_config(&pki.facade, TD).unwrap(),
        whoami_app(hits.clone()),
    )
    .await;
    (server, hits)
}

/// Counts handler invocations, to show a refused client never reached the app.
fn whoami_app(hits: Arc<AtomicUsize>) -> Router {
    Router::new().route(
        "/whoami",
        get(move |peer: Option<Extension<PeerSpiffeId>>| {
            let hits = hits.clone();
            async move {
                hits.fetch_add(1, Ordering::SeqCst);
                peer.map(|Extension(PeerSpiffeId(id))| id)
                    .unwrap_or_default()
            }
        }),
    )
}

/// The leaf certificate a new TLS connection to `addr` presents.
async fn leaf_of_new_connection(
    config: &rustls::ClientConfig,
    addr: SocketAddr,
) -> std::io::Result<Vec<u8>> {
    let tcp = TcpStream::connect(addr).await?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config.clone()));
    let name = ServerName::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST).into());
    let tls = connector.connect(name, tcp).await?;
    let leaf = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec());
    leaf.ok_or_else(|| std::io::Error::other("no peer certificate"))
}

/// DESIGN invariant 15: an executor with an SVID of the trust domain completes the mTLS
/// handshake, and the facade's handler sees its exact SPIFFE ID (which it then checks against
/// the assignment).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_of_the_trust_domain_reaches_the_facade_and_the_handler_sees_its_spiffe_id() {
    let pki = pki().await;
    let (server, hits) = whoami_facade(&pki).await;
    let client = https_client(executor_client_config(&pki.executor, FACADE_ID).unwrap());
    let seen = get_text(&client, &format!("https://{}/whoami", server.addr))
        .await
        .unwrap();
    assert_eq!(seen, EXECUTOR_ID);
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

/// DESIGN invariant 15: a client with an SVID of another trust domain is refused in the
/// handshake and never reaches a handler (the same client with an SVID of the domain does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_of_another_trust_domain_is_refused_by_the_facade() {
    let pki = pki().await;
    let (server, hits) = whoami_facade(&pki).await;
    let foreign = TestCa::new("other.test")
        .unwrap()
        .issue(
            "spiffe://other.test/ci/owner/repo/build",
            Duration::from_secs(600),
        )
        .unwrap();
    let result = raw_tls_get(
        any_server_client_config(Some(&foreign)).unwrap(),
        server.addr,
        "/whoami",
    )
    .await;
    assert!(result.is_err(), "a foreign SVID was accepted: {result:?}");
    // Control: the same client with an SVID of the facade's domain gets an answer.
    let own = pki.executor_api.current_svid().unwrap();
    raw_tls_get(
        any_server_client_config(Some(&own)).unwrap(),
        server.addr,
        "/whoami",
    )
    .await
    .unwrap();
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "only the control reached the app"
    );
}

/// DESIGN invariant 15: a client without a certificate is refused in the handshake and never
/// reaches a handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_a_certificate_is_refused_by_the_facade() {
    let pki = pki().await;
    let (server, hits) = whoami_facade(&pki).await;
    let result = raw_tls_get(
        any_server_client_config(None).unwrap(),
        server.addr,
        "/whoami",
    )
    .await;
    assert!(
        result.is_err(),
        "a client without a certificate was accepted: {result:?}"
    );
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

/// DESIGN invariant 16: the executor verifies the facade's exact SPIFFE ID; a server of the
/// trust domain with another ID is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_expecting_another_facade_spiffe_id_refuses_the_server() {
    let pki = pki().await;
    let (server, hits) = whoami_facade(&pki).await;
    let config =
        executor_client_config(&pki.executor, "spiffe://example.test/ns/ci/sa/impostor").unwrap();
    let client = https_client(config);
    let result = get_text(&client, &format!("https://{}/whoami", server.addr)).await;
    assert!(
        result.is_err(),
        "the executor talked to the wrong facade: {result:?}"
    );
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

/// No DESIGN invariant (operator interface): a Workload API that cannot be reached is reported
/// with its socket path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_workload_api_is_reported_with_its_socket_path() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("unix:{}/absent.sock", dir.path().display());
    let err = x509_source_with_timeout(&endpoint, Duration::from_millis(300))
        .await
        .expect_err("no Workload API is listening");
    assert!(err.to_string().contains(&endpoint), "{err}");
}

/// `/stream` sends `part-1;`, waits until the test releases it, then the rest.
fn streaming_app(release: watch::Receiver<bool>) -> Router {
    let stream_route = get(move || {
        let release = release.clone();
        async move {
            let parts = futures::stream::unfold((0u8, release), |(n, mut release)| async move {
                let chunk: &'static [u8] = match n {
                    0 => b"part-1;",
                    1 => {
                        let _ = release.wait_for(|r| *r).await;
                        b"part-2;"
                    }
                    2 => b"part-3",
                    _ => return None,
                };
                Some((
                    Ok::<_, std::io::Error>(Bytes::from_static(chunk)),
                    (n + 1, release),
                ))
            });
            axum::body::Body::from_stream(parts)
        }
    });
    Router::new().route("/stream", stream_route).route(
        "/peer-cert",
        get(
            |certs: Option<Extension<connectrpc::server::PeerCerts>>| async move {
                certs
                    .and_then(|Extension(c)| c.0.first().map(|leaf| leaf.to_vec()))
                    .unwrap_or_default()
            },
        ),
    )
}

/// DESIGN invariant 16: SVIDs rotate without interrupting a connection open across the
/// rotation, and new connections present the new certificates on both sides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_svid_rotation_during_a_long_streaming_response_does_not_interrupt_it_and_new_connections_use_the_new_certificate()
 {
    let pki = pki().await;
    let (release_tx, release_rx) = watch::channel(false);
    let server = serve(
        facade_server_config(&pki.facade, TD).unwrap(),
        streaming_app(release_rx),
    )
    .await;
    let config = executor_client_config(&pki.executor, FACADE_ID).unwrap();
    let client: HttpsClient<Empty<Bytes>> = https_client(config.clone());
    let resp = client
        .get(format!("https://{}/stream", server.addr).parse().unwrap())
        .await
        .unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(&first[..], b"part-1;");

    let old_facade_leaf = leaf_of_new_connection(&config, server.addr).await.unwrap();
    let new_facade = pki.facade_api.rotate().unwrap();
    let new_executor = pki.executor_api.rotate().unwrap();
    assert_ne!(old_facade_leaf, new_facade.cert_chain_der[0]);

    // New connections: the server presents its new SVID ...
    until(WAIT, "the facade presents its rotated SVID", || {
        let config = config.clone();
        let expected = new_facade.cert_chain_der[0].clone();
        // A handshake racing the swap of both sides' SVIDs may fail once (seen in CI as
        // a decode_error alert); only the open stream above must never be interrupted.
        async move { leaf_of_new_connection(&config, server.addr).await.ok() == Some(expected) }
    })
    .await;
    // ... and the executor presents its new one (a fresh client forces a new connection).
    until(WAIT, "the executor presents its rotated SVID", || {
        let config = config.clone();
        let expected = new_executor.cert_chain_der[0].clone();
        async move {
            let fresh: HttpsClient<Empty<Bytes>> = https_client(config);
            let url = format!("https://{}/peer-cert", server.addr)
                .parse()
                .unwrap();
            // As above: a handshake racing the swap counts as "not yet".
            let Ok(resp) = fresh.get(url).await else {
                return false;
            };
            match resp.into_body().collect().await {
                Ok(body) => body.to_bytes().to_vec() == expected,
                Err(_) => false,
            }
        }
    })
    .await;

    // The stream opened before the rotation finishes intact.
    release_tx.send_replace(true);
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(&rest[..], b"part-2;part-3");
}

const BLOB_CHUNK: usize = 64 * 1024;

fn blob_byte(i: u64) -> u8 {
    (i % 251) as u8
}

fn blob_stream(n: u64) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
    futures::stream::unfold(0u64, move |sent| async move {
        if sent >= n {
            return None;
        }
        let len = (n - sent).min(BLOB_CHUNK as u64);
        let chunk: Vec<u8> = (sent..sent + len).map(blob_byte).collect();
        Some((Ok(Bytes::from(chunk)), sent + len))
    })
}

/// The upstream behind the facade: streams blobs, counts uploads, echoes requests.
fn upstream_app() -> Router {
    Router::new()
        .route(
            "/blob/{n}",
            get(|Path(n): Path<u64>| async move { axum::body::Body::from_stream(blob_stream(n)) }),
        )
        .route(
            "/upload",
            post(|body: axum::body::Body| async move {
                let mut stream = body.into_data_stream();
                let mut total = 0u64;
                let mut ok = true;
                while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
                    let chunk = chunk.unwrap();
                    ok &= chunk
                        .iter()
                        .enumerate()
                        .all(|(i, b)| *b == blob_byte(total + i as u64));
                    total += chunk.len() as u64;
                }
                format!("{total} {ok}")
            }),
        )
        .route(
            "/echo/{*rest}",
            get(
                |State(()): State<()>,
                 uri: http::Uri,
                 headers: http::HeaderMap,
                 peer: Option<Extension<PeerSpiffeId>>| async move {
                    let header = |n: &str| {
                        headers
                            .get(n)
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("-")
                            .to_string()
                    };
                    let id = peer
                        .map(|Extension(PeerSpiffeId(id))| id)
                        .unwrap_or_default();
                    // h2 carries the authority in the URI, HTTP/1.1 in `Host`.
                    let host = uri
                        .authority()
                        .map(|a| a.to_string())
                        .unwrap_or_else(|| header("host"));
                    format!(
                        "{} {} x-test={} proxy-authorization={} x-runner-uuid={} x-runner-token={} peer={id}",
                        uri.path_and_query().map(|p| p.as_str()).unwrap_or(""),
                        host,
                        header("x-test"),
                        header("proxy-authorization"),
                        header("x-runner-uuid"),
                        header("x-runner-token"),
                    )
                },
            ),
        )
        .with_state(())
}

/// The loopback proxy in front of an mTLS upstream; returns its `http://` base URL.
async fn proxy_to(
    pki: &Pki,
    upstream: SocketAddr,
) -> (String, gdr_controller::shutdown::ShutdownGuard) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = executor_client_config(&pki.executor, FACADE_ID).unwrap();
    let (stop, stopped) = gdr_controller::shutdown::shutdown_channel();
    let stop = stop.into_guard();
    let relay = Relay::new(
        ASSIGNMENT,
        &format!("https://{upstream}"),
        &config,
        TOLERANCE,
    )
    .unwrap();
    let credentials = RunnerCredentials::new(ASSIGNMENT, CAPABILITY).unwrap();
    tokio::spawn(async move {
        serve_loopback_proxy(listener, relay, credentials, stopped)
            .await
            .unwrap();
    });
    (format!("http://{addr}"), stop)
}

/// DESIGN invariants 15, 16: the loopback proxy forwards path, query and end-to-end headers
/// (not hop-by-hop ones) to the facade over mTLS under the executor's identity, so non-API
/// traffic such as a git checkout reaches the facade as the runner sent it — with the
/// assignment's runner credentials, which the official runner sets only on RunnerService
/// calls and the facade wants on every request (a client's own are replaced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loopback_proxy_forwards_path_query_and_end_to_end_headers_with_the_executor_identity()
{
    let pki = pki().await;
    let upstream = serve(
        facade_server_config(&pki.facade, TD).unwrap(),
        upstream_app(),
    )
    .await;
    let (proxy, _stop) = proxy_to(&pki, upstream.addr).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let req = http::Request::get(format!(
        "{proxy}/echo/owner/repo.git/info/refs?service=git-upload-pack"
    ))
    .header("x-test", "kept")
    .header("proxy-authorization", "hop-by-hop")
    .header("x-runner-uuid", "gitea-task-666")
    .body(Empty::new())
    .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let text = String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    assert_eq!(
        text,
        format!(
            "/echo/owner/repo.git/info/refs?service=git-upload-pack {} x-test=kept proxy-authorization=- x-runner-uuid={ASSIGNMENT} x-runner-token={CAPABILITY} peer={EXECUTOR_ID}",
            upstream.addr
        )
    );
}

/// DESIGN invariant 16: the loopback proxy streams large bodies both ways through mTLS (50 MiB
/// down, a chunked 50 MiB upload, every byte checked), as checkouts and artifacts need.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loopback_proxy_streams_50_mib_each_way_through_mtls() {
    const N: u64 = 50 * 1024 * 1024;
    let pki = pki().await;
    let upstream = serve(
        facade_server_config(&pki.facade, TD).unwrap(),
        upstream_app(),
    )
    .await;
    let (proxy, _stop) = proxy_to(&pki, upstream.addr).await;

    // Download: verify every byte as it streams past, keep none.
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let resp = client
        .get(format!("{proxy}/blob/{N}").parse().unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut total = 0u64;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            for (i, b) in data.iter().enumerate() {
                assert_eq!(*b, blob_byte(total + i as u64), "byte {}", total + i as u64);
            }
            total += data.len() as u64;
        }
    }
    assert_eq!(total, N);

    // Upload: a streamed request body of unknown length (chunked on the wire).
    let upload = Client::builder(TokioExecutor::new()).build_http();
    let body = StreamBody::new(Box::pin(futures::StreamExt::map(blob_stream(N), |c| {
        c.map(Frame::data)
    })));
    let req = http::Request::post(format!("{proxy}/upload"))
        .body(body)
        .unwrap();
    let resp = upload.request(req).await.unwrap();
    let text = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&text[..], format!("{N} true").as_bytes());
}

/// DESIGN invariant 16: the loopback proxy refuses a facade that does not present the expected
/// SPIFFE ID and answers the runner 502.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loopback_proxy_answers_502_when_the_facade_is_not_the_expected_identity() {
    let pki = pki().await;
    let upstream = serve(
        facade_server_config(&pki.facade, TD).unwrap(),
        upstream_app(),
    )
    .await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config =
        executor_client_config(&pki.executor, "spiffe://example.test/ns/ci/sa/impostor").unwrap();
    // A TLS failure is waited out like an outage, for as long as the tolerance allows.
    let relay = Relay::new(
        ASSIGNMENT,
        &format!("https://{}", upstream.addr),
        &config,
        TOLERANCE,
    )
    .unwrap();
    let credentials = RunnerCredentials::new(ASSIGNMENT, CAPABILITY).unwrap();
    let (stop, stopped) = gdr_controller::shutdown::shutdown_channel();
    let _stop = stop.into_guard();
    tokio::spawn(async move { serve_loopback_proxy(listener, relay, credentials, stopped).await });
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let resp = client
        .get(format!("http://{addr}/echo/x").parse().unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), 502);
}

// ----- the stand-in runner against the mock Gitea --------------------------------------

fn workflow(script: &str) -> String {
    format!(
        "name: ci\non: push\njobs:\n  build:\n    runs-on: [self-hosted, pod]\n    steps:\n      - run: {script}\n"
    )
}

/// A `.runner` for a fresh runner of `mock`, in its own directory (the runner locks it).
fn runner_dir(mock: &RunningMock) -> tempfile::TempDir {
    runner_dir_at(mock, &mock.url)
}

/// [`runner_dir`] with the runner's `address` set to `address`.
fn runner_dir_at(mock: &RunningMock, address: &str) -> tempfile::TempDir {
    let (uuid, token) = mock
        .handle
        .create_runner("standin", &["self-hosted", "pod"], true);
    let dir = tempfile::tempdir().unwrap();
    let file = serde_json::json!({
        "WARNING": "This file is automatically generated by act-runner. Do not edit it manually unless you know what you are doing. Removing this file will cause act runner to re-register as a new runner.",
        "id": 0,
        "uuid": uuid,
        "name": "standin",
        "token": token,
        "address": address,
        "labels": ["self-hosted", "pod"],
        "ephemeral": true,
    });
    std::fs::write(
        dir.path().join(".runner"),
        serde_json::to_vec_pretty(&file).unwrap(),
    )
    .unwrap();
    dir
}

fn spawn_standin(dir: &std::path::Path) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_gitea-runner-standin"))
        .args(["daemon", "--once"])
        .current_dir(dir)
        .env("STANDIN_HEARTBEAT_MS", "100")
        .env("STANDIN_FETCH_INTERVAL_MS", "100")
        .env("STANDIN_FETCH_INTERVAL_MAX_MS", "200")
        .env_remove("STANDIN_SCRIPT")
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

async fn exit_code(mut child: tokio::process::Child) -> i32 {
    tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("the stand-in runner exits")
        .unwrap()
        .code()
        .unwrap_or(-1)
}

fn task_result(mock: &RunningMock, job: JobId) -> i32 {
    mock.handle.job(job).unwrap().task.unwrap().result
}

/// Peer fidelity: as the official runner does, the stand-in takes one task with its `.runner`,
/// streams its log, archives it (`no_more`) and reports success with a stop time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stand_in_runner_completes_a_success_job_against_the_mock_gitea() {
    let mock = MockGitea::start(MockConfig::default()).await.unwrap();
    let job = mock
        .handle
        .queue_workflow("owner/repo", &workflow("standin:success"))
        .unwrap()[0];
    let dir = runner_dir(&mock);
    assert_eq!(exit_code(spawn_standin(dir.path())).await, 0);
    let snapshot = mock.handle.job(job).unwrap();
    assert_eq!(snapshot.status, Status::Success);
    let task = snapshot.task.unwrap();
    assert!(task.log_archived, "the last UpdateLog said no_more");
    assert!(
        task.log_rows.iter().any(|r| r == "job succeeded"),
        "{:?}",
        task.log_rows
    );
    assert!(task.stopped.is_some());
}

/// Peer fidelity: as the official runner does, a failed job is reported as a failure while the
/// process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stand_in_runner_reports_failure_with_exit_status_zero() {
    let mock = MockGitea::start(MockConfig::default()).await.unwrap();
    let job = mock
        .handle
        .queue_workflow("owner/repo", &workflow("standin:failure"))
        .unwrap()[0];
    let dir = runner_dir(&mock);
    assert_eq!(exit_code(spawn_standin(dir.path())).await, 0);
    assert_eq!(mock.handle.job(job).unwrap().status, Status::Failure);
}

/// Peer fidelity: as the official runner does, the stand-in learns of a cancellation from
/// Gitea's answer to its heartbeat, reports the task cancelled and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stand_in_runner_reports_cancelled_after_gitea_cancels_a_hanging_job() {
    let mock = MockGitea::start(MockConfig::default()).await.unwrap();
    let job = mock
        .handle
        .queue_workflow("owner/repo", &workflow("standin:hang"))
        .unwrap()[0];
    let dir = runner_dir(&mock);
    let child = spawn_standin(dir.path());
    mock.handle
        .wait_for(
            |m| {
                m.job(job)
                    .and_then(|j| j.task)
                    .is_some_and(|t| t.heartbeats > 0)
            },
            WAIT,
        )
        .await
        .unwrap();
    mock.handle.cancel_job(job).unwrap();
    assert_eq!(exit_code(child).await, 0);
    assert_eq!(mock.handle.job(job).unwrap().status, Status::Cancelled);
    assert_eq!(
        task_result(&mock, job),
        pb::TaskResult::RESULT_CANCELLED as i32
    );
}

/// Peer fidelity: as the official runner does, SIGTERM makes the stand-in report its task
/// cancelled (logging the signal) and exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_makes_the_stand_in_runner_report_cancelled() {
    let mock = MockGitea::start(MockConfig::default()).await.unwrap();
    let job = mock
        .handle
        .queue_workflow("owner/repo", &workflow("standin:hang"))
        .unwrap()[0];
    let dir = runner_dir(&mock);
    let child = spawn_standin(dir.path());
    let pid = child.id().unwrap();
    mock.handle
        .wait_for(
            |m| {
                m.job(job)
                    .and_then(|j| j.task)
                    .is_some_and(|t| t.heartbeats > 0)
            },
            WAIT,
        )
        .await
        .unwrap();
    // A signal sent by the test itself: a Nix build sandbox has no kill(1) on PATH.
    let pid = rustix::process::Pid::from_raw(i32::try_from(pid).unwrap()).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    assert_eq!(exit_code(child).await, 0);
    assert_eq!(mock.handle.job(job).unwrap().status, Status::Cancelled);
    let rows = mock.handle.job(job).unwrap().task.unwrap().log_rows;
    assert!(rows.iter().any(|r| r.contains("SIGTERM")), "{rows:?}");
}

/// Peer fidelity: a crashing runner exits non-zero without a final report, leaving its task
/// running in Gitea: the case the controller's clean-up must handle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashing_stand_in_runner_exits_non_zero_without_a_final_report() {
    let mock = MockGitea::start(MockConfig::default()).await.unwrap();
    let job = mock
        .handle
        .queue_workflow("owner/repo", &workflow("standin:crash"))
        .unwrap()[0];
    let dir = runner_dir(&mock);
    assert_eq!(exit_code(spawn_standin(dir.path())).await, 3);
    let snapshot = mock.handle.job(job).unwrap();
    assert_eq!(snapshot.status, Status::Running, "nobody reported a result");
    assert!(!snapshot.task.unwrap().log_archived);
}

/// Peer fidelity: the stand-in's checkout streams a blob from its `.runner` address, as the
/// official runner's git checkout reaches Gitea through that address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stand_in_runner_checkout_script_streams_a_blob_from_its_address() {
    let mock = MockGitea::start(MockConfig::default()).await.unwrap();
    let job = mock
        .handle
        .queue_workflow("owner/repo", &workflow("standin:checkout 3000000"))
        .unwrap()[0];
    let dir = runner_dir(&mock);
    assert_eq!(exit_code(spawn_standin(dir.path())).await, 0);
    let snapshot = mock.handle.job(job).unwrap();
    assert_eq!(snapshot.status, Status::Success);
    let rows = snapshot.task.unwrap().log_rows;
    assert!(
        rows.iter().any(|r| r == "checkout: received 3000000 bytes"),
        "{rows:?}"
    );
}

/// A TCP forwarder that can be switched to a black hole: existing connections are cut,
/// new ones are accepted and never answered, as a peer that died behind a load balancer.
struct Switch {
    addr: SocketAddr,
    dark: watch::Sender<bool>,
}

impl Switch {
    async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (dark, seen) = watch::channel(false);
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                let mut seen = seen.clone();
                tokio::spawn(async move {
                    if *seen.borrow() {
                        // Swallowed: held open, never answered.
                        let _ = seen.wait_for(|_| false).await;
                        drop(inbound);
                        return;
                    }
                    let Ok(mut outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = seen.wait_for(|dark| *dark) => {}
                    }
                });
            }
        });
        Switch { addr, dark }
    }

    fn go_dark(&self) {
        self.dark.send_replace(true);
    }
}

/// The stand-in models the official runner's `report_close_timeout`: its whole final
/// report runs under one 10 s deadline, each call bounded by what is left of it, and then
/// the result is given up, never delivered. A Gitea (or facade) that stops answering just
/// before a job ends therefore loses that job's result unless something holds it for the
/// runner (DESIGN invariant 19: the executor's relay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stand_in_gives_its_final_report_up_after_the_runners_close_timeout() {
    use gdr_testkit::standin_runner::{CLOSE_TIMEOUT, GAVE_UP};
    let mock = MockGitea::start(MockConfig::default()).await.unwrap();
    let job = mock
        .handle
        .queue_workflow("owner/repo", &workflow("standin:sleep 1500"))
        .unwrap()[0];
    let target: SocketAddr = mock
        .url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .unwrap();
    let switch = Switch::start(target).await;
    let dir = runner_dir_at(&mock, &format!("http://{}", switch.addr));
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_gitea-runner-standin"))
        .args(["daemon", "--once"])
        .current_dir(dir.path())
        // One report at the start, none in flight when the job ends: only the close talks.
        .env("STANDIN_HEARTBEAT_MS", "60000")
        .env_remove("STANDIN_SCRIPT")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    mock.handle
        .wait_for(
            |m| {
                m.job(job)
                    .and_then(|j| j.task)
                    .is_some_and(|t| t.heartbeats >= 1 && t.runner_starts() > 0)
            },
            WAIT,
        )
        .await
        .expect("the stand-in runs the job and reported once");
    switch.go_dark();
    let dark = tokio::time::Instant::now();
    let out = tokio::time::timeout(WAIT + Duration::from_secs(10), child.wait_with_output())
        .await
        .expect("the final report is given up within the close timeout, not after a 60 s call")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(GAVE_UP), "{stderr}");
    assert!(
        dark.elapsed() >= CLOSE_TIMEOUT,
        "the final report was retried for the whole close timeout"
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "the runner's exit status is not the result"
    );
    assert_ne!(
        mock.handle.job(job).map(|j| j.status),
        Some(Status::Success),
        "the result never reached Gitea"
    );
}

/// DESIGN invariant 13: the Workload API answers `FetchJWTSVID` as a SPIRE agent does —
/// a JWT-SVID whose `sub` is the workload's own SPIFFE ID, for the asked audience, signed
/// by a key of the trust domain's JWT bundle; a request for another SPIFFE ID gets nothing
/// but `PermissionDenied` (as does a workload without identity), one without an audience
/// `InvalidArgument`.
#[tokio::test(flavor = "multi_thread")]
async fn the_workload_api_gives_a_jwt_svid_for_the_workloads_own_spiffe_id_only() {
    use gdr_testkit::spiffe::{Code, fetch_jwt_bundles, fetch_jwt_svids, verify_jwt_svid};
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(TD).unwrap();
    let api = FakeWorkloadApi::start(dir.path(), ca, EXECUTOR_ID)
        .await
        .unwrap();
    let endpoint = api.endpoint();

    let bundles = fetch_jwt_bundles(&endpoint).await.expect("JWT bundles");
    let jwks = bundles
        .get(&format!("spiffe://{TD}"))
        .expect("the trust domain's bundle");
    for asked in [None, Some(EXECUTOR_ID)] {
        let svids = fetch_jwt_svids(&endpoint, &["ci-smoke"], asked)
            .await
            .expect("a JWT-SVID");
        assert_eq!(svids.len(), 1);
        assert_eq!(svids[0].spiffe_id, EXECUTOR_ID);
        let claims = verify_jwt_svid(&svids[0].svid, jwks).expect("the token verifies");
        assert_eq!(claims["sub"], EXECUTOR_ID);
        assert_eq!(claims["aud"], serde_json::json!(["ci-smoke"]));
        assert!(claims["exp"].as_u64() > claims["iat"].as_u64());
    }

    let other = format!("spiffe://{TD}/ci/owner/other/build");
    let refused = fetch_jwt_svids(&endpoint, &["ci-smoke"], Some(&other))
        .await
        .expect_err("another SPIFFE ID");
    assert_eq!(refused.code(), Some(Code::PermissionDenied), "{refused}");
    let no_audience = fetch_jwt_svids(&endpoint, &[], None)
        .await
        .expect_err("no audience");
    assert_eq!(no_audience.code(), Some(Code::InvalidArgument));

    api.clear_identity();
    let none = fetch_jwt_svids(&endpoint, &["ci-smoke"], None)
        .await
        .expect_err("no identity");
    assert_eq!(none.code(), Some(Code::PermissionDenied));
}
