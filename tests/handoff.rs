//! The handoff with real peers: a task fetched from the mock Gitea becomes an
//! assignment, is published to a real nats-server and read back.

use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;
use gdr_controller::queue::{self, ConsumerSettings};
use gdr_core::assignment::{Assignment, EnvelopeError, TaskKey, TaskKeyring, decode, encode_v2};
use gdr_core::backend::Backend;
use gdr_core::identity::IdentityScheme;
use gdr_gitea::{ClientOptions, Credentials, GiteaClient};
use gdr_testkit::mock_gitea::{MockConfig, MockGitea, Trigger};
use gdr_testkit::nats_server::NatsServer;

use crate::queue_common::{policy, stream_settings};

async fn fetched_assignment(keyring: &TaskKeyring) -> (Assignment, Vec<u8>) {
    let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
    mock.handle
        .set_secret("owner/repo", "DEPLOY_KEY", "super-secret-deploy-key");
    let (uuid, token) = mock
        .handle
        .create_runner("ctl", &["self-hosted", "pod"], false);
    let client = GiteaClient::new(
        ClientOptions::new(mock.url.clone()),
        Some(&Credentials::new(uuid, token)),
    )
    .expect("client");
    mock.handle
        .queue_workflow(
            "owner/repo",
            "on: push\njobs:\n  publish:\n    runs-on: [self-hosted, pod]\n    steps: []\n",
        )
        .expect("queue");
    let task = client
        .fetch_task(0)
        .await
        .expect("fetch")
        .task
        .into_option()
        .expect("task");
    let assignment = Assignment::from_task(task, &policy()).expect("assignment");
    let envelope = encode_v2(&assignment, keyring).expect("encode");
    (assignment, envelope)
}

/// DESIGN invariant 13: whoever writes a workflow chooses its job keys, a pull request's
/// author and anyone who can push a branch included. The same job key fetched from Gitea
/// for a push to `main`, to an unprotected branch, to a tag, and for a pull request
/// (`pull_request`, and `pull_request_target`, whose `ref` Gitea rewrites to the base
/// branch) gets an identity of its own per ref, and a pull request's is never `main`'s.
#[tokio::test]
async fn the_same_job_key_fetched_for_main_a_branch_and_a_pull_request_has_an_identity_per_ref() {
    let mock = MockGitea::start(MockConfig::default()).await.expect("mock");
    let (uuid, token) = mock
        .handle
        .create_runner("ctl", &["self-hosted", "pod"], false);
    let client = GiteaClient::new(
        ClientOptions::new(mock.url.clone()),
        Some(&Credentials::new(uuid, token)),
    )
    .expect("client");
    let deploy = "on: [push, pull_request]\njobs:\n  deploy:\n    runs-on: [self-hosted, pod]\n    steps: []\n";
    let pull = |number| Trigger::PullRequest {
        number,
        head: "evil".into(),
        base: "main".into(),
    };
    let target = Trigger::PullRequestTarget {
        number: 9,
        head: "evil".into(),
        base: "main".into(),
    };
    let base = "spiffe://example.org/ci/owner/repo";
    let cases = [
        (Trigger::default(), format!("{base}/branch/main/deploy")),
        (
            Trigger::Push("refs/heads/evil".into()),
            format!("{base}/branch/evil/deploy"),
        ),
        (
            Trigger::Push("refs/tags/v1.0".into()),
            format!("{base}/tag/v1.0/deploy"),
        ),
        (pull(8), format!("{base}/pull/8/deploy")),
        (target, format!("{base}/pull/9/deploy")),
    ];
    for (trigger, expected) in cases {
        mock.handle
            .queue_workflow_for("owner/repo", &trigger, deploy)
            .expect("queue");
        let task = client
            .fetch_task(0)
            .await
            .expect("fetch")
            .task
            .into_option()
            .expect("task");
        let under_job = gdr_core::assignment::DerivationPolicy {
            scheme: IdentityScheme::Job,
            ..policy()
        };
        let legacy = Assignment::from_task(task.clone(), &under_job).expect("job scheme");
        assert_eq!(
            legacy.identity().spiffe_id(),
            format!("{base}/deploy"),
            "the job scheme cannot tell {trigger:?} apart"
        );
        let assignment = Assignment::from_task(task, &policy()).expect("assignment");
        assert_eq!(assignment.identity().spiffe_id(), expected, "{trigger:?}");
    }
}

/// DESIGN invariants 3, 5, 13: a retried publish is recognised by its message ID (the
/// assignment ID) and stores one message; the envelope holds the whole task with its secrets
/// unreadable in the stream, and decodes back to the same assignment, whose backend and SPIFFE
/// ID come from the task alone.
#[tokio::test]
async fn publishing_the_same_assignment_twice_stores_one_message_and_it_decodes_back() {
    let keyring = TaskKeyring::new(TaskKey::from_bytes([7; 32]), vec![]);
    let (assignment, envelope) = fetched_assignment(&keyring).await;
    assert_eq!(assignment.backend(), Backend::Pod);
    assert_eq!(
        assignment.identity().spiffe_id(),
        "spiffe://example.org/ci/owner/repo/branch/main/publish"
    );
    let envelope_text = String::from_utf8_lossy(&envelope);
    assert!(
        !envelope_text.contains("super-secret-deploy-key"),
        "job secrets must not sit readable in the stream"
    );

    let nats = NatsServer::start().await.expect("nats-server");
    let client = async_nats::connect(nats.url()).await.expect("connect");
    let js = jetstream::new(client);
    let mut stream = queue::ensure_stream(&js, &stream_settings())
        .await
        .expect("stream");
    let id = assignment.id().as_str().to_string();
    let first = queue::publish(
        &js,
        &stream_settings(),
        Backend::Pod,
        &id,
        envelope.clone().into(),
    )
    .await
    .expect("publish");
    let second = queue::publish(&js, &stream_settings(), Backend::Pod, &id, envelope.into())
        .await
        .expect("republish");
    assert!(!first.duplicate);
    assert!(
        second.duplicate,
        "the retried publish is recognised as a duplicate"
    );
    assert_eq!(first.sequence, second.sequence);
    assert_eq!(queue::unclaimed(&mut stream).await.expect("info"), 1);

    let consumer = queue::ensure_consumer(
        &stream,
        &stream_settings(),
        Backend::Pod,
        &ConsumerSettings {
            max_ack_pending: 1,
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
        },
    )
    .await
    .expect("consumer");
    let mut batch = consumer
        .fetch()
        .max_messages(1)
        .expires(Duration::from_secs(5))
        .messages()
        .await
        .expect("fetch");
    let message = batch.next().await.expect("one message").expect("message");
    let decoded = decode(&message.payload, &policy(), Some(&keyring)).expect("decode");
    assert_eq!(decoded.id(), assignment.id());
    assert_eq!(
        decoded.task().secrets.get("DEPLOY_KEY").map(String::as_str),
        Some("super-secret-deploy-key")
    );
    message.double_ack().await.expect("ack");
    assert_eq!(
        queue::unclaimed(&mut stream).await.expect("info"),
        0,
        "work-queue retention removes acked messages"
    );
}

/// DESIGN invariants 5, 21: an envelope sealed under another task key is refused as poison (an
/// unknown key), never misread.
#[tokio::test]
async fn an_envelope_without_the_right_key_is_refused_not_misread() {
    let keyring = TaskKeyring::new(TaskKey::from_bytes([7; 32]), vec![]);
    let (_, envelope) = fetched_assignment(&keyring).await;
    let other = TaskKeyring::new(TaskKey::from_bytes([9; 32]), vec![]);
    let err = decode(&envelope, &policy(), Some(&other)).expect_err("refused");
    assert!(matches!(err, EnvelopeError::UnknownKey(_)), "{err}");
    assert!(err.is_poison());
}
