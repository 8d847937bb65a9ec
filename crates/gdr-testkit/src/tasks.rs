//! Gitea tasks and assignments built in memory, for unit tests that need no mock Gitea.

use buffa_types::google::protobuf::{Struct, Value};
use gdr_core::assignment::{Assignment, DerivationPolicy};
use gdr_core::backend::BackendLabels;
use gdr_core::identity::{IdentityScheme, TrustDomain};
use gdr_proto::runner::v1::Task;

/// The policy these helpers derive with: trust domain `example.org`, SPIFFE IDs of the
/// (default) ref scheme, VM label `vm`.
pub fn policy() -> DerivationPolicy {
    DerivationPolicy {
        trust_domain: TrustDomain::new("example.org")
            .unwrap_or_else(|e| panic!("test trust domain: {e}")),
        scheme: IdentityScheme::Ref,
        labels: BackendLabels::default(),
    }
}

/// The ref of the tasks [`task`] builds: a push to `main`.
pub const REF: &str = "refs/heads/main";

/// A task as Gitea hands it out: one job `job_key` of `repository` with `runs_on`, run for
/// a push to [`REF`].
pub fn task(id: i64, repository: &str, job_key: &str, runs_on: &str) -> Task {
    task_on(id, repository, job_key, runs_on, REF)
}

/// [`task`] run for a push to `git_ref`.
pub fn task_on(id: i64, repository: &str, job_key: &str, runs_on: &str, git_ref: &str) -> Task {
    Task {
        id,
        context: Struct::from_fields([
            ("repository", Value::from(repository)),
            ("ref", Value::from(git_ref)),
            ("event_name", Value::from("push")),
        ])
        .into(),
        workflow_payload: Some(
            format!("on: push\njobs:\n  {job_key}:\n    runs-on: {runs_on}\n    steps: []\n")
                .into_bytes(),
        ),
        ..Default::default()
    }
}

/// The assignment of [`task`] under [`policy`].
pub fn assignment(id: i64, runs_on: &str) -> Assignment {
    Assignment::from_task(task(id, "owner/repo", "build", runs_on), &policy())
        .unwrap_or_else(|e| panic!("test assignment: {e}"))
}
