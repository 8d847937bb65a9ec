//! The OpenSandbox VM backend's housekeeping: its warm pool (`vm_warm_pool`), refilled on
//! every lifecycle pass, its members' environment the worker's.

use std::collections::BTreeMap;

use async_trait::async_trait;
use gdr_backends::opensandbox::OpenSandboxBackend;
use gdr_core::executor::ExecutorError;

use super::upkeep;
use crate::lifecycle::{Housekeeping, Upkeep};

#[async_trait]
impl Housekeeping for OpenSandboxBackend {
    async fn sweep(&self) -> Result<usize, ExecutorError> {
        // With no pool configured, only every interval: warm sandboxes left from an
        // earlier configuration are deleted.
        if self.warm_pool_configured() {
            return Ok(0);
        }
        Ok(self.reconcile_warm_pool().await?.deleted)
    }

    async fn every_pass(&self) -> Result<Upkeep, ExecutorError> {
        if !self.warm_pool_configured() {
            return Ok(Upkeep::default());
        }
        Ok(upkeep(self.reconcile_warm_pool().await?))
    }

    fn standby_environment(&self, environment: BTreeMap<&'static str, String>) {
        self.set_standby_environment(
            environment
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
        );
    }
}

#[cfg(test)]
mod tests {
    /// The reasons the backends delete a warm environment for, and the outcomes they
    /// count a job's claim by, are the label values the metrics' reference documents.
    #[test]
    fn the_shared_warm_pools_reasons_and_outcomes_are_the_metrics_documented_values() {
        assert_eq!(
            gdr_backends::warm::DELETION_KINDS,
            crate::job_metrics::WARM_DISCARD_REASONS
        );
        assert_eq!(
            gdr_backends::warm::CLAIM_OUTCOMES,
            crate::job_metrics::WARM_CLAIM_OUTCOMES
        );
    }
}
