//! What a Pod's status says about its executor ([`Phase`]), with the real reasons.

use gdr_core::executor::Phase;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

use super::manifest::CONTAINER;

fn with_message(reason: &str, message: Option<&str>) -> String {
    match message.filter(|m| !m.is_empty()) {
        Some(m) => format!("{reason}: {m}"),
        None => reason.to_owned(),
    }
}

fn executor_status(pod: &Pod) -> Option<&ContainerStatus> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == CONTAINER)
}

/// Why a Pending Pod is not running: the scheduler's verdict (`Unschedulable: 0/3 nodes …`)
/// or the container's waiting reason (`ImagePullBackOff: …`, `CreateContainerConfigError`).
fn waiting_reason(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    if let Some(c) = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
    {
        return Some(with_message(
            c.reason.as_deref().unwrap_or("Unschedulable"),
            c.message.as_deref(),
        ));
    }
    let waiting = executor_status(pod)?.state.as_ref()?.waiting.as_ref()?;
    Some(with_message(
        waiting.reason.as_deref().unwrap_or("Waiting"),
        waiting.message.as_deref(),
    ))
}

/// Longest part of a container's termination message that goes into a reason.
const MESSAGE_CHARS: usize = 512;

/// The last non-empty line of a container's termination message, bounded. With
/// `FallbackToLogsOnError` the kubelet puts the tail of the container's log there (up to
/// 80 lines), whose last line is the executor's error (`error: …`).
fn last_line(message: Option<&str>) -> Option<String> {
    let line = message?
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())?;
    Some(match line.char_indices().nth(MESSAGE_CHARS) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line.to_owned(),
    })
}

/// Why a Pod ended: eviction, deadline or node shutdown (`status.reason`), else the
/// container's termination (`OOMKilled`, exit code, the last line of its termination
/// message).
fn end_reason(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    if let Some(reason) = status.reason.as_deref().filter(|r| !r.is_empty()) {
        return Some(with_message(reason, status.message.as_deref()));
    }
    let t = executor_status(pod)?.state.as_ref()?.terminated.as_ref()?;
    let what = match t.reason.as_deref() {
        Some("OOMKilled") => {
            "OOMKilled: the executor container exceeded its memory limit".to_owned()
        }
        Some(r) => with_message(r, last_line(t.message.as_deref()).as_deref()),
        None => "the executor container ended".to_owned(),
    };
    Some(format!("{what} (exit code {})", t.exit_code))
}

/// The executor's container is running (the kubelet's last word).
fn executor_running(pod: &Pod) -> bool {
    executor_status(pod)
        .and_then(|c| c.state.as_ref())
        .is_some_and(|s| s.running.is_some())
}

/// The phase of the executor in `pod`.
pub fn phase(pod: &Pod) -> Phase {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    // A Pod deleted with a grace period keeps its executor running until the kubelet's
    // SIGTERM has had its effect: the executor passes it to its runner, which cancels the
    // job and reports that (DESIGN invariant 16). Calling it finished while it still runs
    // would fail the job in Gitea before the runner's own, truer report. If the node never
    // acts, the Pod is removed at the grace period's end (gone), or the runner's silence
    // fails the job.
    let terminating = pod.metadata.deletion_timestamp.is_some() && !executor_running(pod);
    match phase {
        Some("Succeeded") => Phase::Finished {
            success: true,
            reason: end_reason(pod),
        },
        Some("Failed") => Phase::Finished {
            success: false,
            reason: end_reason(pod).or_else(|| Some("the Pod failed".into())),
        },
        _ if terminating => Phase::Finished {
            success: false,
            reason: Some("the Pod is being deleted".into()),
        },
        Some("Running") => Phase::Running,
        Some("Unknown") => Phase::Finished {
            success: false,
            reason: Some(
                "NodeLost: the Pod's phase is Unknown (its node stopped reporting)".into(),
            ),
        },
        _ => Phase::Starting {
            reason: waiting_reason(pod),
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({ "metadata": { "name": "p" }, "status": status })).unwrap()
    }

    #[test]
    fn pending_pods_report_the_scheduler_or_the_container_waiting_reason() {
        let p = pod(
            json!({ "phase": "Pending", "conditions": [{ "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes are available" }] }),
        );
        assert_eq!(
            phase(&p),
            Phase::Starting {
                reason: Some("Unschedulable: 0/3 nodes are available".into())
            }
        );
        let p = pod(
            json!({ "phase": "Pending", "containerStatuses": [{ "name": "executor", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": { "waiting": { "reason": "ImagePullBackOff", "message": "Back-off pulling image \"x\"" } } }] }),
        );
        assert_eq!(
            phase(&p),
            Phase::Starting {
                reason: Some("ImagePullBackOff: Back-off pulling image \"x\"".into())
            }
        );
    }

    /// DESIGN invariants 12, 16: a Pod being deleted is finished once its executor no longer
    /// runs; while the executor's container still runs (the grace period, the runner
    /// reporting its cancellation) it is running.
    #[test]
    fn a_pod_being_deleted_is_finished_only_once_its_executor_stopped_running() {
        let deleting = |status: serde_json::Value| -> Pod {
            serde_json::from_value(json!({
                "metadata": { "name": "p", "deletionTimestamp": "2026-12-06T00:00:00Z" },
                "status": status,
            }))
            .unwrap()
        };
        let running = deleting(
            json!({ "phase": "Running", "containerStatuses": [{ "name": "executor", "image": "i", "imageID": "", "ready": true, "restartCount": 0, "state": { "running": { "startedAt": "2026-12-06T00:00:00Z" } } }] }),
        );
        assert_eq!(phase(&running), Phase::Running);
        let stopped = deleting(
            json!({ "phase": "Running", "containerStatuses": [{ "name": "executor", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": { "terminated": { "reason": "Error", "exitCode": 143 } } }] }),
        );
        assert_eq!(
            phase(&stopped),
            Phase::Finished {
                success: false,
                reason: Some("the Pod is being deleted".into())
            }
        );
        let unscheduled = deleting(json!({ "phase": "Pending" }));
        assert!(matches!(
            phase(&unscheduled),
            Phase::Finished { success: false, .. }
        ));
    }

    #[test]
    fn ended_pods_report_eviction_oom_and_exit_codes() {
        let p = pod(
            json!({ "phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory." }),
        );
        assert_eq!(
            phase(&p),
            Phase::Finished {
                success: false,
                reason: Some("Evicted: The node was low on resource: memory.".into())
            }
        );
        let p = pod(
            json!({ "phase": "Failed", "containerStatuses": [{ "name": "executor", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": { "terminated": { "reason": "OOMKilled", "exitCode": 137 } } }] }),
        );
        let Phase::Finished {
            success: false,
            reason: Some(r),
        } = phase(&p)
        else {
            panic!()
        };
        assert!(
            r.starts_with("OOMKilled") && r.ends_with("(exit code 137)"),
            "{r}"
        );
        // FallbackToLogsOnError: the message is the log's tail; its last line is the error.
        let p = pod(
            json!({ "phase": "Failed", "containerStatuses": [{ "name": "executor", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": { "terminated": { "reason": "Error", "exitCode": 1, "message": "{\"level\":\"INFO\"}\nerror: no SVID\n\n" } } }] }),
        );
        assert_eq!(
            phase(&p),
            Phase::Finished {
                success: false,
                reason: Some("Error: error: no SVID (exit code 1)".into())
            }
        );
        assert!(matches!(
            phase(&pod(json!({ "phase": "Unknown" }))),
            Phase::Finished { success: false, .. }
        ));
        assert!(matches!(
            phase(&pod(json!({ "phase": "Succeeded" }))),
            Phase::Finished { success: true, .. }
        ));
    }
}
