//! One poller's handoffs awaiting their JetStream acknowledgement (DESIGN invariant 2).
//!
//! A poller fetches again while its earlier publishes wait for their acks, so the fetch
//! round trip and the publish round trip overlap; at most `publish_window` of its fetched
//! tasks are unacknowledged at once. Each handoff is its own task retrying its publish
//! under the assignment's message ID until it is stored, refused, or lost at shutdown
//! (invariants 3 and 4); the backlog slot it holds counts from fetch until then.

use std::future::Future;

use tokio::task::{JoinError, JoinSet};

use super::Report;

/// The handoffs of one poller not yet stored, refused or lost.
pub(super) struct InFlight {
    handoffs: JoinSet<Report>,
    /// The most handoffs outstanding at once (≥ 1).
    window: usize,
    /// What the finished handoffs did.
    report: Report,
    /// The first handoff that panicked or was aborted.
    failure: Option<JoinError>,
}

impl InFlight {
    pub(super) fn new(window: usize) -> Self {
        InFlight {
            handoffs: JoinSet::new(),
            window: window.max(1),
            report: Report::default(),
            failure: None,
        }
    }

    /// Starts `handoff`, then waits until fewer than the window are outstanding, so the
    /// next fetch cannot take the poller past it. Window 1 is the pre-pipelining poller:
    /// nothing else is fetched until this task is stored.
    pub(super) async fn start<F>(&mut self, handoff: F)
    where
        F: Future<Output = Report> + Send + 'static,
    {
        self.handoffs.spawn(handoff);
        while let Some(joined) = self.handoffs.try_join_next() {
            self.settled(joined);
        }
        while self.handoffs.len() >= self.window {
            match self.handoffs.join_next().await {
                Some(joined) => self.settled(joined),
                None => break,
            }
        }
    }

    /// Waits for every outstanding handoff (shutdown bounds each publish, invariant 4).
    pub(super) async fn finish(mut self) -> (Report, Option<JoinError>) {
        while let Some(joined) = self.handoffs.join_next().await {
            self.settled(joined);
        }
        (self.report, self.failure)
    }

    fn settled(&mut self, joined: Result<Report, JoinError>) {
        match joined {
            Ok(report) => self.report.merge(report),
            Err(e) => {
                tracing::error!(error = %e, "a task's handoff stopped abnormally");
                self.failure.get_or_insert(e);
            }
        }
    }
}
