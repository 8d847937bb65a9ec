//! The Workload API this crate serves, through the `spiffe` crate's client as a workload
//! (the executor, the job's `spire-agent api fetch`) calls it: each workload gets its own
//! identity only, JWT-SVIDs follow the audience rules SPIRE applies, open streams see every
//! change, and a caller that goes away mid-stream costs the others nothing.

use std::time::Duration;

use futures::StreamExt as _;
use spiffe::{JwtSvid, SpiffeId, WorkloadApiClient};

use super::*;

const OWN: &str = "spiffe://example.org/ci/octo-org/hello/build";
const OTHER: &str = "spiffe://example.org/ci/octo-org/hello/deploy";
/// Only a bound on a hang.
const WAIT: Duration = Duration::from_secs(10);

async fn serve(dir: &tempfile::TempDir) -> RunningWorkloadApi {
    let ca = LocalCa::new("example.org").unwrap();
    WorkloadApi::start(dir.path(), ca, OWN).await.unwrap()
}

async fn client(api: &RunningWorkloadApi) -> WorkloadApiClient {
    WorkloadApiClient::connect_to(api.endpoint()).await.unwrap()
}

async fn next<T>(stream: &mut (impl futures::Stream<Item = T> + Unpin)) -> T {
    tokio::time::timeout(WAIT, stream.next())
        .await
        .expect("the stream yields within the bound")
        .expect("the stream is open")
}

/// DESIGN invariant 13: the X.509-SVID a workload fetches is of its own SPIFFE ID, chained
/// to the trust domain's bundle served with it.
#[tokio::test]
async fn a_workload_fetches_an_x509_svid_of_its_own_id_and_the_bundle_of_its_trust_domain() {
    let dir = tempfile::tempdir().unwrap();
    let api = serve(&dir).await;
    let context = client(&api).await.fetch_x509_context().await.unwrap();
    let svid = context.default_svid().expect("one SVID");
    assert_eq!(svid.spiffe_id().to_string(), OWN);
    let domain = spiffe::TrustDomain::new("example.org").unwrap();
    let bundle = context.bundle_set().get(&domain).expect("its bundle");
    assert_eq!(bundle.authorities().len(), 1);
    assert_eq!(bundle.authorities()[0].as_ref(), api.shared.ca.bundle_der());
    assert_eq!(api.fetch_count(), 1);
}

/// DESIGN invariant 13 and SPIRE's rules for `FetchJWTSVID`: a JWT-SVID for the caller's
/// own ID with the audience asked for, verifiable with the JWT bundle; another ID is
/// refused as SPIRE refuses it (no identity issued); an empty audience or a malformed ID
/// is an invalid argument.
#[tokio::test]
async fn a_jwt_svid_is_issued_for_the_callers_own_id_and_audience_only() {
    let dir = tempfile::tempdir().unwrap();
    let api = serve(&dir).await;
    let client = client(&api).await;
    let svid = client.fetch_jwt_svid(["ci-smoke"], None).await.unwrap();
    assert_eq!(svid.spiffe_id().to_string(), OWN);
    assert_eq!(svid.audience(), ["ci-smoke"]);
    let own = SpiffeId::new(OWN).unwrap();
    let named = client.fetch_jwt_svid(["a", "b"], Some(&own)).await.unwrap();
    assert_eq!(named.audience(), ["a", "b"]);
    // Signed by a key the trust domain's JWT bundle publishes.
    let bundles = client.fetch_jwt_bundles().await.unwrap();
    let domain = spiffe::TrustDomain::new("example.org").unwrap();
    let bundle = bundles.get(&domain).expect("the trust domain's JWT bundle");
    assert!(
        bundle.find_jwt_authority(svid.key_id()).is_some(),
        "{} is not in the bundle",
        svid.key_id()
    );
    let parsed = JwtSvid::parse_insecure(svid.token()).unwrap();
    assert_eq!(parsed.spiffe_id().to_string(), OWN);

    let other = SpiffeId::new(OTHER).unwrap();
    let refused = client.fetch_jwt_svid(["ci-smoke"], Some(&other)).await;
    assert!(
        matches!(refused, Err(spiffe::WorkloadApiError::NoIdentityIssued)),
        "{refused:?}"
    );
    let no_audience = client.fetch_jwt_svid([" "], None).await.unwrap_err();
    assert!(no_audience.is_invalid_argument(), "{no_audience:?}");
}

/// A workload's open streams follow its identity: a rotation pushes a new X.509-SVID of
/// the same ID, a new identity replaces it, and an identity taken away is `PermissionDenied`
/// (no identity issued) on the X.509 and the JWT bundle streams alike.
#[tokio::test]
async fn open_streams_see_every_rotation_and_an_identity_taken_away() {
    let dir = tempfile::tempdir().unwrap();
    let api = serve(&dir).await;
    let client = client(&api).await;
    let mut svids = client.stream_x509_svids().await.unwrap();
    let mut bundles = client.stream_jwt_bundles().await.unwrap();
    let first = next(&mut svids).await.unwrap();
    next(&mut bundles).await.unwrap();

    api.rotate().unwrap();
    let rotated = next(&mut svids).await.unwrap();
    assert_eq!(rotated.spiffe_id().to_string(), OWN);
    assert_ne!(
        rotated.leaf().as_bytes(),
        first.leaf().as_bytes(),
        "a new certificate"
    );
    next(&mut bundles).await.unwrap();

    api.set_identity(OTHER).unwrap();
    assert_eq!(
        next(&mut svids).await.unwrap().spiffe_id().to_string(),
        OTHER
    );
    next(&mut bundles).await.unwrap();

    api.clear_identity();
    assert!(matches!(
        next(&mut svids).await,
        Err(spiffe::WorkloadApiError::NoIdentityIssued)
    ));
    assert!(matches!(
        next(&mut bundles).await,
        Err(spiffe::WorkloadApiError::NoIdentityIssued)
    ));
    let fresh = client.fetch_x509_svid().await;
    assert!(
        matches!(fresh, Err(spiffe::WorkloadApiError::NoIdentityIssued)),
        "{fresh:?}"
    );
}

/// A caller that disconnects mid-stream ends only its own stream: the server goes on
/// serving the streams that stay and new callers, and rotations reach them.
#[tokio::test]
async fn a_caller_that_disconnects_mid_stream_costs_the_others_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let api = serve(&dir).await;
    let staying = client(&api).await;
    let mut kept = staying.stream_x509_svids().await.unwrap();
    next(&mut kept).await.unwrap();
    {
        let leaving = client(&api).await;
        let mut gone = leaving.stream_x509_svids().await.unwrap();
        next(&mut gone).await.unwrap();
        // Both the stream and its connection are dropped here, mid-stream.
    }
    api.rotate().unwrap();
    let rotated = next(&mut kept).await.unwrap();
    assert_eq!(
        rotated.leaf().as_bytes(),
        api.current_svid().unwrap().cert_chain_der[0].as_slice()
    );
    let newcomer = client(&api).await.fetch_x509_svid().await.unwrap();
    assert_eq!(newcomer.spiffe_id().to_string(), OWN);
    assert_eq!(api.fetch_count(), 3);
}

/// A SPIFFE ID is `spiffe://`, a trust domain and a path, as SPIRE's parser wants it.
#[test]
fn only_a_spiffe_id_with_a_trust_domain_and_a_path_is_one() {
    assert!(is_spiffe_id(OWN));
    for not in [
        "",
        "spiffe://",
        "spiffe://example.org",
        "spiffe:///path",
        "spiffe://example.org/",
        "https://example.org/a",
    ] {
        assert!(!is_spiffe_id(not), "{not:?}");
    }
}

#[test]
fn a_ca_file_that_cannot_be_read_is_named_and_keeps_its_cause() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ca-key.pem"), "not a key").unwrap();
    std::fs::write(dir.path().join("ca.json"), "{not json").unwrap();
    let err = LocalCa::load_or_create(dir.path(), "example.org").unwrap_err();
    let WorkloadApiError::CaFile { what, source, .. } = &err else {
        panic!("{err}")
    };
    assert!(what.ends_with("ca.json is not JSON"), "{err}");
    assert!(
        source.downcast_ref::<serde_json::Error>().is_some(),
        "{err}"
    );
    let cause = std::error::Error::source(&err).expect("the parser's error is the cause");
    assert_eq!(
        err.to_string(),
        format!("CA files in {}: {what}: {cause}", dir.path().display())
    );
}
