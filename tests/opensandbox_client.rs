//! The OpenSandbox Lifecycle API client against the real `opensandbox-server` 1.1.1
//! (`gdr_testkit::opensandbox`): every status path the backend depends on, as the real
//! server produces it. The shared server gives up a blocking create after
//! `CREATE_TIMEOUT` (10 s; 60 s in production) and a full pool after
//! `POOL_ACQUISITION_TIMEOUT` (2 s; 30 s in production).
//!
//! Each test pins what the product's client makes of the real server's answers and cites
//! the invariant the VM backend builds on it. The in-memory cluster under the server is a
//! test peer: where a test depends on it behaving as a real cluster would (Pods held
//! unstarted, failing to start), a `Peer fidelity` line says so.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use gdr_backends::opensandbox::client::{CreateSandbox, ListQuery};
use gdr_backends::opensandbox::{ClientError, LifecycleClient};
use gdr_core::metadata::{ExecutorMetadata, MetadataCodec, is_label_value};
use gdr_testkit::eventually;
use gdr_testkit::opensandbox::{POOL_ACQUISITION_TIMEOUT, PoolSpec};

use crate::opensandbox_common::{DEADLINE, client, client_with, pool, server, settings, unique};

fn request(pool: &str, tag: &str) -> CreateSandbox {
    CreateSandbox {
        pool: pool.to_owned(),
        entrypoint: vec!["/bin/sh".into(), "-c".into(), "exec sleep 60".into()],
        env: BTreeMap::from([("CI_ASSIGNMENT_ID".into(), "gitea-task-1".into())]),
        metadata: BTreeMap::from([("gdr.test/tag".into(), tag.to_owned())]),
        timeout: Some(Duration::from_secs(600)),
    }
}

fn by_tag(tag: &str, page_size: u32) -> ListQuery {
    ListQuery {
        metadata: BTreeMap::from([("gdr.test/tag".into(), tag.to_owned())]),
        states: Vec::new(),
        page_size,
    }
}

/// Waits until no sandbox carries `tag`.
async fn until_gone(client: &LifecycleClient, tag: &str, what: &str) {
    eventually(DEADLINE, what, || async {
        client
            .list(&by_tag(tag, 0))
            .await
            .unwrap()
            .is_empty()
            .then_some(())
    })
    .await;
}

async fn gone(client: &LifecycleClient, id: &str) {
    eventually(DEADLINE, "the deleted sandbox answers 404", || async {
        client.get(id).await.unwrap().is_none().then_some(())
    })
    .await;
}

/// DESIGN invariant 11: a sandbox comes only from the pool (`extensions.poolRef`), with the
/// entrypoint, environment, metadata and timeout sent; get, list, merge-patch and delete work
/// on it, and a second delete reads as already gone.
#[tokio::test]
async fn a_pool_sandbox_is_created_read_listed_patched_and_deleted() {
    let server = server().await;
    let client = client(server);
    let pool = pool(server, PoolSpec::new(2)).await;
    let tag = unique("crud");
    let created = client.create(&request(&pool, &tag)).await.unwrap();
    assert_eq!(
        created.status.state, "Running",
        "create returns once the sandbox runs"
    );
    assert_eq!(created.metadata()["gdr.test/tag"], tag);
    let expires = created
        .expires_at
        .expect("a sandbox with a timeout expires");
    let lifetime = expires.duration_since(created.created_at).unwrap();
    assert_eq!(lifetime.as_secs(), 600, "expiresAt is createdAt + timeout");

    let cluster = server.control.sandbox(&created.id).await.unwrap().unwrap();
    assert_eq!(cluster.batchsandbox["spec"]["poolRef"], pool.as_str());
    let process = &cluster.batchsandbox["spec"]["taskTemplate"]["spec"]["process"];
    assert!(
        process["command"][2]
            .as_str()
            .unwrap()
            .ends_with("/bin/sh -c 'exec sleep 60'"),
        "the entrypoint is the task's command: {process}"
    );
    assert!(
        process["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "CI_ASSIGNMENT_ID" && e["value"] == "gitea-task-1"),
        "the environment reaches the task: {process}"
    );

    let got = client.get(&created.id).await.unwrap().expect("get");
    assert_eq!(got.id, created.id);
    assert_eq!(got.metadata()["gdr.test/tag"], tag);
    let listed = client.list(&by_tag(&tag, 0)).await.unwrap();
    assert_eq!(
        listed.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        vec![created.id.as_str()],
        "the metadata filter selects exactly the sandbox"
    );

    let patched = client
        .patch_metadata(
            &created.id,
            &BTreeMap::from([
                ("gdr.test/claimed".into(), Some("true".into())),
                ("gdr.test/tag".into(), None),
            ]),
        )
        .await
        .unwrap();
    let metadata = patched.metadata();
    assert_eq!(
        metadata.get("gdr.test/claimed").map(String::as_str),
        Some("true")
    );
    assert!(
        !metadata.contains_key("gdr.test/tag"),
        "null removes a key (RFC 7396)"
    );
    assert!(
        client.list(&by_tag(&tag, 0)).await.unwrap().is_empty(),
        "the filter follows the patch"
    );

    assert!(
        client.delete(&created.id).await.unwrap(),
        "delete of an existing sandbox"
    );
    gone(&client, &created.id).await;
    assert!(
        !client.delete(&created.id).await.unwrap(),
        "a second delete reads as already gone (404)"
    );
    assert!(
        matches!(
            client.patch_metadata(&created.id, &BTreeMap::new()).await,
            Err(ClientError::NotFound { .. })
        ),
        "patching a gone sandbox is NotFound"
    );
}

/// DESIGN invariant 6: a wrong API key is a configuration error naming its setting
/// (`opensandbox_api_key_file`), which the VM backend treats as a failing backend (the job
/// stays queued until the operator fixes it), not as a refusal of the job.
#[tokio::test]
async fn a_wrong_api_key_is_a_configuration_error() {
    let server = server().await;
    let client = client_with(server, settings(server), "not-the-key");
    let error = client.get("anything").await.unwrap_err();
    match &error {
        ClientError::Unauthorized {
            status: 401, api, ..
        } => {
            assert_eq!(api.code.as_deref(), Some("INVALID_API_KEY"));
        }
        other => panic!("expected 401 Unauthorized, got {other}"),
    }
    assert!(error.is_configuration());
    assert!(
        error.to_string().contains("opensandbox_api_key_file"),
        "{error}"
    );
    let pool = pool(server, PoolSpec::new(1)).await;
    assert!(matches!(
        client.create(&request(&pool, "x")).await,
        Err(ClientError::Unauthorized { status: 401, .. })
    ));
}

/// DESIGN invariant 11: metadata values outside the label rules are refused with the server's
/// 400 `{code, message}`, which the client keeps.
#[tokio::test]
async fn an_invalid_metadata_value_is_refused_with_the_servers_400_message() {
    let server = server().await;
    let client = client(server);
    let pool = pool(server, PoolSpec::new(1)).await;
    let mut bad = request(&pool, "x");
    bad.metadata
        .insert("gdr.test/bad".into(), "has space".into());
    match client.create(&bad).await {
        Err(ClientError::Invalid {
            status: 400, api, ..
        }) => {
            assert_eq!(api.code.as_deref(), Some("SANDBOX::INVALID_METADATA_LABEL"));
            assert!(!api.message.is_empty());
        }
        other => panic!("expected 400 Invalid, got {other:?}"),
    }
}

/// DESIGN invariant 12: a spec the server refuses (FastAPI's own 422 body, which the server
/// does not normalise) is read into a message naming the field: the reason the job is failed
/// with in Gitea.
#[tokio::test]
async fn a_timeout_below_the_servers_minimum_is_refused_with_fastapis_422_body() {
    let server = server().await;
    let client = client(server);
    let pool = pool(server, PoolSpec::new(1)).await;
    let mut short = request(&pool, "x");
    short.timeout = Some(Duration::from_secs(30));
    match client.create(&short).await {
        Err(ClientError::Invalid {
            status: 422, api, ..
        }) => {
            assert_eq!(api.code.as_deref(), Some("greater_than_equal"));
            assert!(api.message.starts_with("body.timeout: "), "{}", api.message);
        }
        other => panic!("expected 422 Invalid, got {other:?}"),
    }
}

/// DESIGN invariant 6: a missing pool is a configuration error naming the pool, which the VM
/// backend treats as a failing backend (the job stays queued), not as a missing sandbox or a
/// refused job.
#[tokio::test]
async fn a_create_naming_a_missing_pool_says_which_pool() {
    let server = server().await;
    let client = client(server);
    let missing = unique("no-such-pool");
    let error = client.create(&request(&missing, "x")).await.unwrap_err();
    assert!(
        matches!(&error, ClientError::PoolNotFound { pool, .. } if *pool == missing),
        "{error}"
    );
    assert!(error.is_configuration());
    assert!(
        error
            .to_string()
            .contains(&format!("pool `{missing}` not found")),
        "{error}"
    );
}

/// DESIGN invariant 6: a full pool is 429 with the server's `Retry-After` (its pool acquisition
/// timeout) and leaves no sandbox behind; once room frees, the create works.
#[tokio::test]
async fn a_full_pool_answers_429_with_retry_after_until_room_frees() {
    let server = server().await;
    let client = client(server);
    let pool = pool(server, PoolSpec::new(1)).await;
    let tag = unique("full");
    let first = client.create(&request(&pool, &tag)).await.unwrap();
    match client.create(&request(&pool, &tag)).await {
        Err(ClientError::PoolFull { retry_after, api }) => {
            assert_eq!(retry_after, Some(POOL_ACQUISITION_TIMEOUT));
            assert_eq!(
                api.code.as_deref(),
                Some("KUBERNETES::POOL_CAPACITY_EXHAUSTED")
            );
        }
        other => panic!("expected 429 PoolFull, got {other:?}"),
    }
    let left: Vec<String> = client
        .list(&by_tag(&tag, 0))
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(
        left,
        vec![first.id.clone()],
        "the refused sandbox was deleted by the server"
    );
    client.delete(&first.id).await.unwrap();
    gone(&client, &first.id).await;
    let second = client.create(&request(&pool, &tag)).await.unwrap();
    assert_eq!(second.status.state, "Running");
    client.delete(&second.id).await.unwrap();
}

/// DESIGN invariant 8: a create blocks until the VM runs (the client's create timeout is above
/// the server's), and meanwhile the starting sandbox is listed as Pending, so a find by
/// assignment sees it.
/// Peer fidelity: the in-memory cluster holds a pool's Pods unstarted until told, as a slow VM
/// boot does.
#[tokio::test]
async fn a_slow_create_blocks_until_the_sandbox_runs() {
    let server = server().await;
    let client = client(server);
    let mut hold = PoolSpec::new(1);
    hold.start_delay = None;
    let pool = pool(server, hold).await;
    let tag = unique("slow");
    let create = tokio::spawn({
        let client = client.clone();
        let request = request(&pool, &tag);
        async move { client.create(&request).await }
    });
    let pending = eventually(DEADLINE, "the starting sandbox is listed", || async {
        client
            .list(&by_tag(&tag, 0))
            .await
            .unwrap()
            .into_iter()
            .next()
    })
    .await;
    assert_eq!(pending.status.state, "Pending");
    assert!(
        !create.is_finished(),
        "the create is still blocked while the sandbox starts"
    );
    server
        .control
        .put_pool(&pool, &PoolSpec::new(1))
        .await
        .unwrap();
    let created = create.await.unwrap().unwrap();
    assert_eq!(created.id, pending.id);
    assert_eq!(created.status.state, "Running");
    client.delete(&created.id).await.unwrap();
}

/// DESIGN invariant 8: a sandbox that never becomes ready within the server's create timeout is
/// the server's 504, which the client names; the server deleted the sandbox, so the backend's
/// retry creates afresh.
/// Peer fidelity: Pods held unstarted make the real server time out as on a real cluster, and
/// the deletion goes through the pool allocation's finalizer: the sandbox reads `Stopping`
/// until its Pod is released, then is gone.
#[tokio::test]
async fn a_sandbox_that_never_starts_gives_504_and_is_deleted_by_the_server() {
    let server = server().await;
    let client = client(server);
    let mut hold = PoolSpec::new(1);
    hold.start_delay = None;
    let pool = pool(server, hold).await;
    let tag = unique("never");
    let error = client.create(&request(&pool, &tag)).await.unwrap_err();
    assert!(
        matches!(error, ClientError::CreateTimedOut { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("POD_READY_TIMEOUT"), "{error}");
    // The server deleted it before answering: at once, nothing of it is left but `Stopping`.
    let states: Vec<String> = client
        .list(&by_tag(&tag, 0))
        .await
        .unwrap()
        .into_iter()
        .map(|sandbox| sandbox.status.state)
        .collect();
    assert!(
        states.iter().all(|state| state == "Stopping"),
        "the server deleted it before its 504: {states:?}"
    );
    until_gone(&client, &tag, "the deleted sandbox is gone").await;
}

/// DESIGN invariant 8: a client that gives up before the server leaves the sandbox starting,
/// which is why the backend finds before it creates and why its create timeout must stay above
/// the server's.
#[tokio::test]
async fn a_client_timeout_below_the_servers_leaves_the_sandbox_starting() {
    let server = server().await;
    let mut hold = PoolSpec::new(1);
    hold.start_delay = None;
    let pool = pool(server, hold).await;
    let tag = unique("impatient");
    let mut short = settings(server);
    short.create_timeout = Duration::from_millis(500);
    let impatient = client_with(server, short, &server.api_key);
    let error = impatient.create(&request(&pool, &tag)).await.unwrap_err();
    assert!(
        matches!(error, ClientError::Timeout { op: "create", .. }),
        "{error}"
    );
    let client = client(server);
    // The server may not have stored the sandbox yet when the client gave up (a loaded
    // machine): it goes on creating, so the one sandbox appears; never a second.
    let left = eventually(DEADLINE, "the server goes on creating", || async {
        let left = client.list(&by_tag(&tag, 0)).await.unwrap();
        (!left.is_empty()).then_some(left)
    })
    .await;
    assert_eq!(left.len(), 1, "one create, one sandbox");
    server
        .control
        .put_pool(&pool, &PoolSpec::new(1))
        .await
        .unwrap();
    client.delete(&left[0].id).await.unwrap();
}

/// Peer fidelity: a pool Pod that fails to start makes the real server answer 500
/// `KUBERNETES::POD_FAILED` and clean up, as on a real cluster, and the client keeps it a
/// server error.
#[tokio::test]
async fn a_pod_that_fails_to_start_is_a_server_error() {
    let server = server().await;
    let client = client(server);
    let mut failing = PoolSpec::new(1);
    failing.fail_start = true;
    let pool = pool(server, failing).await;
    let tag = unique("failing");
    match client.create(&request(&pool, &tag)).await {
        Err(ClientError::Status {
            status: 500, api, ..
        }) => {
            assert_eq!(api.code.as_deref(), Some("KUBERNETES::POD_FAILED"));
        }
        other => panic!("expected 500, got {other:?}"),
    }
    // The server deletes the failed sandbox in the background of its answer.
    until_gone(&client, &tag, "the failed sandbox is deleted by the server").await;
}

/// DESIGN invariant 12: a sandbox whose task failed reads `Failed` with the server's reason, so
/// the backend reports the executor as ended, with its cause.
#[tokio::test]
async fn a_failed_task_reads_failed_with_its_reason() {
    let server = server().await;
    let client = client(server);
    let pool = pool(server, PoolSpec::new(1)).await;
    let created = client
        .create(&request(&pool, &unique("fails")))
        .await
        .unwrap();
    assert!(server.control.fail_sandbox(&created.id).await.unwrap());
    let got = client.get(&created.id).await.unwrap().unwrap();
    assert_eq!(got.status.state, "Failed");
    assert_eq!(got.status.reason.as_deref(), Some("TASK_FAILED"));
    client.delete(&created.id).await.unwrap();
}

/// DESIGN invariant 7: recovery sees every sandbox: a list follows every page through
/// `hasNextPage`, and a page size above the server's 200 is clamped rather than refused.
#[tokio::test]
async fn a_list_follows_every_page() {
    let server = server().await;
    let client = client(server);
    let pool = pool(server, PoolSpec::new(7)).await;
    let tag = unique("pages");
    let mut ids = Vec::new();
    for _ in 0..7 {
        ids.push(client.create(&request(&pool, &tag)).await.unwrap().id);
    }
    let first = client.list_page(&by_tag(&tag, 3), 1).await.unwrap();
    assert_eq!((first.items.len(), first.pagination.total_items), (3, 7));
    assert!(first.pagination.has_next_page);
    let last = client.list_page(&by_tag(&tag, 3), 3).await.unwrap();
    assert_eq!(last.items.len(), 1);
    assert!(!last.pagination.has_next_page);
    let mut all: Vec<String> = client
        .list(&by_tag(&tag, 3))
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    all.sort();
    ids.sort();
    assert_eq!(
        all, ids,
        "three pages of 3, 3 and 1 give every sandbox once"
    );
    let clamped = client.list(&by_tag(&tag, 500)).await.unwrap();
    assert_eq!(clamped.len(), 7);
    for id in &ids {
        client.delete(id).await.unwrap();
    }
}

/// DESIGN invariant 11: annotation-like values far longer than a label value travel as codec
/// chunks, each a valid metadata value, and come back losslessly.
#[tokio::test]
async fn long_metadata_values_round_trip_as_codec_chunks() {
    let server = server().await;
    let client = client(server);
    let pool = pool(server, PoolSpec::new(1)).await;
    let codec = MetadataCodec::new("gdr.test/").unwrap();
    let tag = unique("long");
    let metadata = ExecutorMetadata {
        labels: BTreeMap::from([("gdr.test/tag".into(), tag.clone())]),
        annotations: BTreeMap::from([
            (
                "gdr.test/repository".into(),
                "some-organisation/a-repository-with-a-long-name".repeat(8),
            ),
            ("gdr.test/unicode".into(), "ジョブ — «job» / ✓ ".repeat(20)),
        ]),
    };
    let flat = codec.flatten(&metadata).unwrap();
    assert!(flat.len() > 10, "the values need many chunks");
    assert!(flat.values().all(|v| is_label_value(v)));
    let mut req = request(&pool, &tag);
    req.metadata = flat;
    let created = client.create(&req).await.unwrap();
    let got = client.get(&created.id).await.unwrap().unwrap();
    assert_eq!(codec.unflatten(&got.metadata()).unwrap(), metadata);
    let listed = client.list(&by_tag(&tag, 0)).await.unwrap();
    assert_eq!(codec.unflatten(&listed[0].metadata()).unwrap(), metadata);
    client.delete(&created.id).await.unwrap();
}

/// No DESIGN invariant (sandbox expiry): renewal moves a sandbox's expiry, and the server's
/// refusals (a past expiry is 400, a sandbox without expiry 409) are typed.
#[tokio::test]
async fn renewal_moves_the_expiry_and_its_refusals_are_typed() {
    let server = server().await;
    let client = client(server);
    let pool = pool(server, PoolSpec::new(2)).await;
    let created = client
        .create(&request(&pool, &unique("renew")))
        .await
        .unwrap();
    let target = SystemTime::now() + Duration::from_secs(7200);
    let renewed = client.renew_expiration(&created.id, target).await.unwrap();
    let drift = renewed
        .duration_since(target)
        .unwrap_or_else(|e| e.duration());
    assert!(
        drift < Duration::from_secs(1),
        "the server recorded the requested expiry"
    );
    let got = client.get(&created.id).await.unwrap().unwrap();
    assert_eq!(got.expires_at, Some(renewed));
    let past = SystemTime::now() - Duration::from_secs(60);
    assert!(matches!(
        client.renew_expiration(&created.id, past).await,
        Err(ClientError::Invalid { status: 400, .. })
    ));
    let mut forever = request(&pool, &unique("forever"));
    forever.timeout = None;
    let unexpiring = client.create(&forever).await.unwrap();
    assert!(matches!(
        client.renew_expiration(&unexpiring.id, target).await,
        Err(ClientError::Conflict { .. })
    ));
    client.delete(&created.id).await.unwrap();
    client.delete(&unexpiring.id).await.unwrap();
}

/// DESIGN invariant 6: an unreachable server is a transport error, retried by the backend (the
/// job stays queued), not a configuration error or a refusal.
#[tokio::test]
async fn an_unreachable_server_is_a_transport_error() {
    let server = server().await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut nowhere = settings(server);
    nowhere.base_url = format!("http://127.0.0.1:{port}/v1").parse().unwrap();
    let client = client_with(server, nowhere, "key");
    let error = client.get("x").await.unwrap_err();
    assert!(matches!(error, ClientError::Transport { .. }), "{error}");
    assert!(!error.is_configuration());
}
