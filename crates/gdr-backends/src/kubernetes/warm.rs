//! Warm Pods (`pod_warm_pool`, a profile's `warm_pool`; issue 39 item 5): executor Pods
//! created before any job, so a job's start does not wait for the Pod's.
//!
//! A warm Pod is created without an assignment: no assignment metadata (not `runner=true`,
//! so no listing of executors sees it), no identity entry, no capability Secret; its
//! executor waits in standby (`gdr_executor::standby`). A job claims one with a single
//! merge patch carrying the Pod's `resourceVersion` as a precondition, which writes the
//! assignment's metadata and turns `<prefix>warm` from `true` to `claimed`: of two claims
//! of one Pod (two workers, a surplus deletion) exactly one succeeds, the other gets 409,
//! so one Pod never serves two jobs (DESIGN invariant 8). Only then are its capability
//! Secret created and its identity bound; from there it is an executor like any, deleted
//! after its job. A claimed Pod never goes back to the pool.
//!
//! What to create and delete is [`plan`], a pure function of the configured counts and the
//! members observed on the cluster, run on every lifecycle pass: a restart loses nothing,
//! since nothing is remembered between passes.

pub use crate::warm::{
    CLAIM_OUTCOMES, CLAIMED, CLAIMED_AT_KEY, ClaimCounts, DELETION_KINDS, Member, Plan, State,
    TEMPLATE_KEY, UNCLAIMED, WARM_KEY, candidates, plan, template_fingerprint,
};

/// Annotation key (under the prefix): the profile label a member was made for.
pub const PROFILE_KEY: &str = "warm-profile";
/// Annotation key (under the prefix): the assignment's `CI_*` variables (JSON, no
/// capability), which the downward API hands the standby executor.
pub const ENVIRONMENT_KEY: &str = "executor-environment";
/// Name prefix of pool members.
pub const NAME_PREFIX: &str = "gitea-warm-";
