//! Helpers of the tests against the real OpenSandbox server (`opensandbox_*.rs`).
#![allow(dead_code)]

use std::time::Duration;

use gdr_backends::opensandbox::{ApiKey, ClientSettings, LifecycleClient};
use gdr_testkit::opensandbox::{OpenSandboxServer, PoolSpec};

/// Longest wait for an observable state.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// The server shared by this test binary.
pub async fn server() -> &'static OpenSandboxServer {
    match OpenSandboxServer::shared().await {
        Ok(server) => server,
        Err(e) => panic!("{e}"),
    }
}

/// A rustls configuration as the product builds it (aws-lc-rs); the tests speak plain http.
pub fn tls() -> rustls::ClientConfig {
    rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("tls versions")
    .with_root_certificates(rustls::RootCertStore::empty())
    .with_no_client_auth()
}

/// Client settings for the shared server: the create timeout stays above the server's.
pub fn settings(server: &OpenSandboxServer) -> ClientSettings {
    let mut settings = ClientSettings::new(server.url.parse().expect("url"));
    settings.create_timeout = gdr_testkit::opensandbox::CREATE_TIMEOUT + Duration::from_secs(20);
    settings
}

/// A client of the shared server with its key.
pub fn client(server: &OpenSandboxServer) -> LifecycleClient {
    client_with(server, settings(server), &server.api_key)
}

/// A client with other settings or another key.
pub fn client_with(
    server: &OpenSandboxServer,
    settings: ClientSettings,
    key: &str,
) -> LifecycleClient {
    let _ = server;
    LifecycleClient::new(
        settings,
        &ApiKey::from_file_contents(key).expect("key"),
        tls(),
    )
    .expect("client")
}

/// A name no other test uses (pools, metadata values).
pub fn unique(name: &str) -> String {
    format!("{name}-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

/// A new pool of the shared server; its name.
pub async fn pool(server: &OpenSandboxServer, spec: PoolSpec) -> String {
    let name = unique("pool");
    server
        .control
        .put_pool(&name, &spec)
        .await
        .expect("put pool");
    name
}
