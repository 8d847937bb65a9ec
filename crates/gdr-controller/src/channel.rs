//! What every executor of a backend is told about its facade and its runner, in one
//! place for the three who tell it: the worker (every executor it creates), the warm pool
//! (a warm executor before any job) and the facade (a warm executor once its job claimed
//! it).

use std::collections::BTreeMap;
use std::time::Duration;

use gdr_core::assignment::Assignment;
use gdr_core::backend::Backend;
use gdr_core::capability::{Capability, CapabilityKey};
use gdr_core::executor::{ExecutorRecord, ExecutorSpec, env};
use gdr_core::metadata::{ExecutorMetadata, MetadataCodec};

/// What a fresh executor of one backend is told about its facade and its runner: the
/// worker's settings take it for every executor it creates
/// ([`crate::worker::WorkerSettings::spec`]), a warm environment's executor gets its
/// job-independent part before any job, and the facade
/// ([`crate::facade::BackendStandbys`]) hands a warm executor the rest once a job claimed
/// it, so all three come from the same settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutorChannel {
    /// Where the executor reaches the facade.
    pub facade_url: String,
    /// The facade's SPIFFE ID the executor verifies.
    pub facade_spiffe_id: String,
    /// The label the executor's runner declares for the backend.
    pub runner_label: String,
    /// How long the executor holds its runner's reports while the facade is unreachable.
    pub report_outage_tolerance: Duration,
}

impl ExecutorChannel {
    /// The executor spec of `assignment`, its runner token `capability`, its metadata from
    /// `codec`.
    pub fn spec(
        &self,
        assignment: &Assignment,
        capability: Capability,
        codec: &MetadataCodec,
    ) -> ExecutorSpec {
        ExecutorSpec::new(
            assignment,
            capability,
            codec,
            &self.facade_url,
            &self.facade_spiffe_id,
            &self.runner_label,
        )
        .with_report_outage_tolerance(self.report_outage_tolerance)
    }

    /// The part of every `backend` executor's environment ([`ExecutorSpec::environment`])
    /// that is the same whatever the job: what a warm environment's executor
    /// (`vm_warm_pool`), started before any job, is given.
    pub fn standby_environment(&self, backend: Backend) -> BTreeMap<&'static str, String> {
        BTreeMap::from([
            (env::FACADE_URL, self.facade_url.clone()),
            (env::FACADE_SPIFFE_ID, self.facade_spiffe_id.clone()),
            (env::BACKEND, backend.as_str().to_owned()),
            (env::RUNNER_LABEL, self.runner_label.clone()),
            (
                env::REPORT_OUTAGE_TOLERANCE,
                self.report_outage_tolerance.as_secs().to_string(),
            ),
        ])
    }

    /// The environment a fresh executor of `record`'s assignment gets, the capability
    /// excepted ([`ExecutorSpec::environment`], as the worker's spec has it).
    pub fn environment(
        &self,
        record: &ExecutorRecord,
        key: &CapabilityKey,
    ) -> BTreeMap<String, String> {
        let spec = ExecutorSpec {
            assignment: record.assignment.clone(),
            // Needed to build the spec; the facade adds the capability itself.
            capability: key.issue(record.assignment.id()),
            facade_url: self.facade_url.clone(),
            facade_spiffe_id: self.facade_spiffe_id.clone(),
            // Neither is part of the environment.
            runs_on: Vec::new(),
            metadata: ExecutorMetadata::default(),
            runner_label: self.runner_label.clone(),
            report_outage_tolerance: Some(self.report_outage_tolerance),
        };
        spec.environment()
            .into_iter()
            .filter(|(name, _)| *name != env::CAPABILITY)
            .map(|(name, value)| (name.to_owned(), value))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use gdr_core::identity::TrustDomain;

    use super::*;

    /// Issue 39 item 5: a warm executor's environment is every executor's minus the
    /// job's own variables (its assignment, capability and SPIFFE ID), from the one
    /// place specs are built, so a claimed warm sandbox's executor runs as a fresh one
    /// would.
    #[test]
    fn the_standby_environment_is_every_executors_environment_without_the_jobs_own_variables() {
        let channel = ExecutorChannel {
            facade_url: "https://facade.test:8443".into(),
            facade_spiffe_id: "spiffe://example.org/gitea-runner-facade".into(),
            runner_label: "kata".into(),
            report_outage_tolerance: Duration::from_secs(1800),
        };
        let assignment = gdr_testkit::backend_contract::assignment(
            7,
            "octo-org/hello-world",
            "build",
            Backend::Vm,
            &TrustDomain::new("example.org").unwrap(),
        );
        let key = CapabilityKey::new(b"0123456789abcdef0123456789abcdef").unwrap();
        let mut every = channel
            .spec(
                &assignment,
                key.issue(assignment.id()),
                &MetadataCodec::default(),
            )
            .environment();
        for per_job in [env::ASSIGNMENT_ID, env::CAPABILITY, env::SPIFFE_ID] {
            assert!(every.remove(per_job).is_some(), "{per_job}");
        }
        assert_eq!(channel.standby_environment(Backend::Vm), every);
    }
}
