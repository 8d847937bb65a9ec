//! What the runner reported and the facade does not have yet (DESIGN invariant 19).
//!
//! While the facade is unreachable the executor answers the runner's `UpdateLog` and
//! `UpdateTask` itself, as Gitea would, and keeps what it acknowledged here until it is
//! delivered: log rows from the index Gitea acknowledged last, in order; the latest task
//! state with its outputs. Gitea's rules make the later delivery safe: `UpdateLog` appends
//! only at its own acknowledged index (a repeated row is never written twice) and the first
//! result of a task wins.
//!
//! Deliveries fit the facade's request limit ([`FACADE_REQUEST_LIMIT`]), and a batch the
//! facade still finds too large is split. A batch the facade refuses for good is dropped
//! alone; Gitea's index stays contiguous (the next rows take the dropped ones' place) and
//! the runner's index, which counted the dropped rows, is translated from then on.
//!
//! This module is pure bookkeeping (no I/O); [`crate::relay`] moves the messages.

use std::collections::{BTreeMap, BTreeSet};

use buffa::{Message, MessageField};
use gdr_proto::runner::v1 as pb;

/// Rows per delivered `UpdateLog` (the official runner sends up to 100 per call; a backlog
/// after a long outage goes in fewer, larger calls).
pub const DELIVERY_BATCH: usize = 500;

/// The largest request the facade reads: connectrpc's default message and body limit,
/// which the facade keeps (it answers `resource_exhausted`, HTTP 429, beyond it).
pub const FACADE_REQUEST_LIMIT: usize = 4 * 1024 * 1024;

/// Room in a delivered `UpdateLog` for its own fields (task ID, index, `no_more`).
const REQUEST_OVERHEAD: usize = 64;

/// Bytes of log content the executor holds at most. Beyond it the runner's rows are not
/// acknowledged, so the runner keeps them itself (it resends from the acknowledged index),
/// and a job that logs without bound cannot exhaust the executor's memory.
pub const MAX_HELD_BYTES: usize = 256 * 1024 * 1024;

/// One delivery to make next, in order: log rows before the task state (the official
/// runner's `Close` order), so the result never reaches Gitea before the rows it closes.
#[derive(Debug, Clone, PartialEq)]
pub enum Delivery {
    /// Log rows from Gitea's acknowledged index.
    Log {
        /// The request to send.
        request: pb::UpdateLogRequest,
        /// How many held rows it carries.
        rows: usize,
    },
    /// The latest task state (with every output not yet confirmed).
    State {
        /// The request to send.
        request: pb::UpdateTaskRequest,
        /// Which version of the held state it is (a newer one may arrive meanwhile).
        generation: u64,
    },
}

impl Delivery {
    /// Whether it carries the task's final result.
    pub fn carries_result(&self) -> bool {
        match self {
            Delivery::Log { .. } => false,
            Delivery::State { request, .. } => is_final(request),
        }
    }
}

/// The held reports of one task.
#[derive(Debug, Default)]
pub struct Outbox {
    task_id: i64,
    /// Rows Gitea acknowledged (its `ack_index`), as far as the executor knows.
    acked: i64,
    /// Rows acknowledged to the runner that Gitea never got (refused for good): the
    /// runner's index of a row is Gitea's plus this.
    shift: i64,
    /// The rows Gitea never got, as `(first, count)` in the runner's index, in order: the
    /// runner's step log ranges are translated through them.
    dropped: Vec<(i64, i64)>,
    /// A delivery size the facade (or something in front of it) refused as too large.
    too_large: Option<usize>,
    /// Rows acknowledged to the runner beyond `acked`, in order.
    rows: Vec<pb::LogRow>,
    held_bytes: usize,
    /// The runner closed its log (`no_more`) and Gitea has not been told yet.
    no_more: bool,
    /// The latest state the runner reported that Gitea has not got, and its outputs.
    state: Option<pb::UpdateTaskRequest>,
    generation: u64,
    /// Output keys Gitea confirmed.
    sent_outputs: BTreeSet<String>,
    /// The last result Gitea answered for the task (`CANCELLED` after a cancel); a local
    /// answer repeats it and never makes one up.
    server_result: buffa::EnumValue<pb::TaskResult>,
}

impl Outbox {
    /// Nothing is held: the runner's calls may go straight to the facade again.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty() && !self.no_more && self.state.is_none()
    }

    /// Rows held now.
    pub fn held_rows(&self) -> usize {
        self.rows.len()
    }

    /// Gitea's last answer said the task was cancelled.
    pub fn cancelled_by_gitea(&self) -> bool {
        self.server_result == buffa::EnumValue::from(pb::TaskResult::RESULT_CANCELLED)
    }

    /// Whether the task's result is held.
    pub fn holds_result(&self) -> bool {
        self.state.as_ref().is_some_and(is_final)
    }

    /// The runner's `UpdateLog` as Gitea must get it: after rows were refused for good, the
    /// runner's index runs ahead of Gitea's. Returns whether the request changed.
    pub fn to_gitea(&self, request: &mut pb::UpdateLogRequest) -> bool {
        if self.shift == 0 {
            return false;
        }
        request.index = request.index.saturating_sub(self.shift).max(0);
        true
    }

    /// The runner's `UpdateTask` as Gitea must get it: each step's log range, counted in
    /// the runner's index, translated into Gitea's (the rows Gitea never got leave it), so
    /// Gitea slices each step's log from the step's own rows. Returns whether it changed.
    pub fn to_gitea_state(&self, request: &mut pb::UpdateTaskRequest) -> bool {
        if self.dropped.is_empty() {
            return false;
        }
        let Some(state) = request.state.as_option_mut() else {
            return false;
        };
        for step in &mut state.steps {
            let end = step.log_index.saturating_add(step.log_length);
            let start = gitea_index(&self.dropped, step.log_index);
            step.log_index = start;
            step.log_length = gitea_index(&self.dropped, end).saturating_sub(start).max(0);
        }
        true
    }

    /// Gitea's answer to a translated `UpdateLog` as the runner must hear it.
    pub fn to_runner(&self, answer: &mut pb::UpdateLogResponse) {
        answer.ack_index = answer.ack_index.saturating_add(self.shift);
    }

    /// Gitea answered an `UpdateLog` the runner sent through (`answer` as Gitea gave it):
    /// its acknowledged index.
    pub fn passed_log(&mut self, request: &pb::UpdateLogRequest, answer: &pb::UpdateLogResponse) {
        self.task_id = request.task_id;
        if self.rows.is_empty() {
            self.acked = answer.ack_index;
        }
    }

    /// Gitea answered an `UpdateTask` the runner sent through.
    pub fn passed_state(
        &mut self,
        request: &pb::UpdateTaskRequest,
        answer: &pb::UpdateTaskResponse,
    ) {
        if let Some(state) = request.state.as_option() {
            self.task_id = state.id;
        }
        self.learn(answer);
    }

    fn learn(&mut self, answer: &pb::UpdateTaskResponse) {
        self.sent_outputs
            .extend(answer.sent_outputs.iter().cloned());
        if let Some(state) = answer.state.as_option() {
            self.server_result = state.result;
        }
    }

    /// Holds an `UpdateLog` of the runner and answers it as Gitea would: rows are taken
    /// only at the acknowledged index (a gap is not written), and the answer acknowledges
    /// every row now held.
    pub fn hold_log(&mut self, request: &pb::UpdateLogRequest) -> pb::UpdateLogResponse {
        self.task_id = request.task_id;
        let held = i64::try_from(self.rows.len()).unwrap_or(i64::MAX);
        // In the runner's index.
        let mut end = self.acked.saturating_add(self.shift).saturating_add(held);
        if self.rows.is_empty() && request.index > end {
            // The runner heard an acknowledgement this executor could not read; it is
            // Gitea's word, so it stands.
            self.acked = request.index.saturating_sub(self.shift);
            end = request.index;
        }
        if request.index <= end {
            let skip = usize::try_from(end - request.index).unwrap_or(usize::MAX);
            for row in request.rows.iter().skip(skip) {
                let size = row.content.len();
                if self.held_bytes.saturating_add(size) > MAX_HELD_BYTES {
                    break;
                }
                self.held_bytes += size;
                self.rows.push(row.clone());
                end += 1;
            }
            let complete = end >= request.index.saturating_add(row_count(request));
            if request.no_more && complete {
                self.no_more = true;
            }
        }
        pb::UpdateLogResponse {
            ack_index: end,
            ..Default::default()
        }
    }

    /// Holds an `UpdateTask` of the runner and answers it as Gitea would: the state's ID
    /// with the result Gitea last gave (or, for a final report, the result now held), and
    /// every output key as sent (they will be).
    pub fn hold_state(&mut self, request: pb::UpdateTaskRequest) -> pb::UpdateTaskResponse {
        let reported = request.state.as_option().map_or(
            buffa::EnumValue::from(pb::TaskResult::RESULT_UNSPECIFIED),
            |s| s.result,
        );
        let task_id = request.state.as_option().map_or(self.task_id, |s| s.id);
        self.task_id = task_id;
        // Outputs are insert-if-absent in Gitea: the first value of a key wins.
        let mut outputs: BTreeMap<String, String> = self
            .state
            .as_ref()
            .map(|s| {
                s.outputs
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            })
            .unwrap_or_default();
        for (k, v) in &request.outputs {
            outputs.entry(k.clone()).or_insert_with(|| v.clone());
        }
        let held_final = self.state.as_ref().is_some_and(is_final);
        // A final state is never replaced by a later heartbeat: the first result wins.
        if !held_final || is_final(&request) {
            self.state = Some(request);
        }
        if let Some(state) = self.state.as_mut() {
            state.outputs = outputs.clone().into_iter().collect();
        }
        self.generation += 1;
        let unspecified = buffa::EnumValue::from(pb::TaskResult::RESULT_UNSPECIFIED);
        let result = if self.server_result != unspecified {
            self.server_result
        } else if held_final {
            self.state
                .as_ref()
                .and_then(|s| s.state.as_option())
                .map_or(reported, |s| s.result)
        } else {
            reported
        };
        let mut sent: BTreeSet<String> = self.sent_outputs.clone();
        sent.extend(outputs.into_keys());
        pb::UpdateTaskResponse {
            state: MessageField::some(pb::TaskState {
                id: task_id,
                result,
                ..Default::default()
            }),
            sent_outputs: sent.into_iter().collect(),
            ..Default::default()
        }
    }

    /// The next delivery, if anything is held: as many rows as fit the facade's limit (or
    /// a smaller one it answered), at least one.
    pub fn next(&self) -> Option<Delivery> {
        if !self.rows.is_empty() || self.no_more {
            let limit = self.too_large.map_or(FACADE_REQUEST_LIMIT, |refused| {
                refused.min(FACADE_REQUEST_LIMIT)
            });
            let budget = limit.saturating_sub(REQUEST_OVERHEAD);
            let mut take = 0;
            let mut bytes = 0usize;
            for row in self.rows.iter().take(DELIVERY_BATCH) {
                let size = wire_size(row);
                if take > 0 && bytes.saturating_add(size) > budget {
                    break;
                }
                bytes = bytes.saturating_add(size);
                take += 1;
            }
            let rows = self.rows[..take].to_vec();
            return Some(Delivery::Log {
                request: pb::UpdateLogRequest {
                    task_id: self.task_id,
                    index: self.acked,
                    rows,
                    no_more: self.no_more && take == self.rows.len(),
                    ..Default::default()
                },
                rows: take,
            });
        }
        self.state.as_ref().map(|request| {
            let mut request = request.clone();
            self.to_gitea_state(&mut request);
            Delivery::State {
                request,
                generation: self.generation,
            }
        })
    }

    /// Gitea answered a delivered `UpdateLog`: drop what it acknowledged.
    pub fn delivered_log(
        &mut self,
        request: &pb::UpdateLogRequest,
        answer: &pb::UpdateLogResponse,
    ) -> Logged {
        let ack = answer.ack_index;
        let sent = row_count(request);
        if ack < self.acked {
            // Gitea has fewer rows than the runner was told: those are gone, and the held
            // ones go on at Gitea's own index.
            let lost = self.acked - ack;
            self.dropped.push((ack.saturating_add(self.shift), lost));
            self.shift = self.shift.saturating_add(lost);
            self.acked = ack;
            return Logged::Behind {
                lost: usize::try_from(lost).unwrap_or(usize::MAX),
            };
        }
        if ack == self.acked && sent > 0 {
            return Logged::NotTaken;
        }
        let drop = usize::try_from(ack - self.acked)
            .unwrap_or(usize::MAX)
            .min(self.rows.len());
        for row in self.rows.drain(..drop) {
            self.held_bytes = self.held_bytes.saturating_sub(row.content.len());
        }
        self.acked = ack;
        if request.no_more && ack >= request.index.saturating_add(sent) {
            self.no_more = false;
        }
        Logged::Progress
    }

    /// The facade answered that `request` (`bytes` long) is too large. Returns whether it
    /// can be split: then later deliveries stay below half its size; a single row cannot.
    pub fn too_large(&mut self, request: &pb::UpdateLogRequest, bytes: usize) -> bool {
        if request.rows.len() < 2 {
            return false;
        }
        let half = bytes / 2;
        self.too_large = Some(self.too_large.map_or(half, |limit| limit.min(half)));
        true
    }

    /// Gitea answered a delivered `UpdateTask`.
    pub fn delivered_state(&mut self, generation: u64, answer: &pb::UpdateTaskResponse) {
        self.learn(answer);
        if generation == self.generation {
            self.state = None;
        }
    }

    /// The facade refused a delivered `UpdateLog` for good (e.g. a row larger than it
    /// takes, an archived log): only its rows are dropped, and the rows after them take
    /// their place in Gitea's log. Returns the refused rows.
    pub fn refuse_log(&mut self, request: &pb::UpdateLogRequest) -> RefusedRows {
        let first = self.acked.saturating_add(self.shift);
        let count = request.rows.len().min(self.rows.len());
        for row in self.rows.drain(..count) {
            self.held_bytes = self.held_bytes.saturating_sub(row.content.len());
        }
        let dropped = i64::try_from(count).unwrap_or(i64::MAX);
        self.dropped.push((first, dropped));
        self.shift = self.shift.saturating_add(dropped);
        if request.no_more {
            self.no_more = false;
        }
        RefusedRows { first, count }
    }

    /// Gitea refused the held state for good.
    pub fn drop_state(&mut self, generation: u64) {
        if generation == self.generation {
            self.state = None;
        }
    }
}

/// What Gitea's answer to a delivered `UpdateLog` did to what is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logged {
    /// The acknowledged rows are no longer held.
    Progress,
    /// Gitea has fewer rows than the runner was told (an acknowledgement the executor
    /// adopted from the runner was wrong): these are lost; what is held goes on at Gitea's
    /// index.
    Behind {
        /// Rows lost.
        lost: usize,
    },
    /// Gitea took none of the rows at its own index: they cannot be delivered.
    NotTaken,
}

/// Log rows dropped after a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefusedRows {
    /// The first one's index, as the runner counted it.
    pub first: i64,
    /// How many.
    pub count: usize,
}

/// Gitea's index of the row the runner counted as `runner`: less every row before it that
/// Gitea never got (`dropped`, runner's index).
fn gitea_index(dropped: &[(i64, i64)], runner: i64) -> i64 {
    let before: i64 = dropped
        .iter()
        .map(|&(first, count)| runner.saturating_sub(first).clamp(0, count))
        .sum();
    runner.saturating_sub(before).max(0)
}

/// A row's share of an encoded `UpdateLogRequest`: its tag, its length, the row.
fn wire_size(row: &pb::LogRow) -> usize {
    const TAG_AND_LENGTH: usize = 1 + 5;
    usize::try_from(row.encoded_len())
        .unwrap_or(usize::MAX)
        .saturating_add(TAG_AND_LENGTH)
}

fn row_count(request: &pb::UpdateLogRequest) -> i64 {
    i64::try_from(request.rows.len()).unwrap_or(i64::MAX)
}

/// A report that carries the task's result.
fn is_final(request: &pb::UpdateTaskRequest) -> bool {
    request
        .state
        .as_option()
        .is_some_and(|s| s.result != buffa::EnumValue::from(pb::TaskResult::RESULT_UNSPECIFIED))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn rows(from: usize, n: usize) -> Vec<pb::LogRow> {
        (from..from + n)
            .map(|i| pb::LogRow {
                content: format!("row {i}"),
                ..Default::default()
            })
            .collect()
    }

    fn log(index: i64, rows: Vec<pb::LogRow>, no_more: bool) -> pb::UpdateLogRequest {
        pb::UpdateLogRequest {
            task_id: 7,
            index,
            rows,
            no_more,
            ..Default::default()
        }
    }

    fn state(result: pb::TaskResult, outputs: &[(&str, &str)]) -> pb::UpdateTaskRequest {
        pb::UpdateTaskRequest {
            state: MessageField::some(pb::TaskState {
                id: 7,
                result: result.into(),
                ..Default::default()
            }),
            outputs: outputs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..Default::default()
        }
    }

    fn ack(n: i64) -> pb::UpdateLogResponse {
        pb::UpdateLogResponse {
            ack_index: n,
            ..Default::default()
        }
    }

    fn result_of(answer: &pb::UpdateTaskResponse) -> pb::TaskResult {
        answer
            .state
            .as_option()
            .and_then(|s| s.result.as_known())
            .unwrap()
    }

    /// DESIGN invariant 19: held rows are acknowledged to the runner as Gitea would, resent
    /// rows are not held twice, and delivery starts at Gitea's own index.
    #[test]
    fn held_rows_are_acknowledged_once_and_delivered_from_giteas_index() {
        let mut outbox = Outbox::default();
        outbox.passed_log(&log(0, rows(0, 3), false), &ack(3));
        assert_eq!(outbox.hold_log(&log(3, rows(3, 2), false)).ack_index, 5);
        // The runner resends from an older index: only the new row is taken.
        assert_eq!(outbox.hold_log(&log(4, rows(4, 2), false)).ack_index, 6);
        // A gap is not written.
        assert_eq!(outbox.hold_log(&log(9, rows(9, 1), false)).ack_index, 6);
        assert_eq!(outbox.hold_log(&log(6, vec![], true)).ack_index, 6);
        let Some(Delivery::Log { request, rows: n }) = outbox.next() else {
            panic!("rows first")
        };
        assert_eq!((request.index, n, request.no_more), (3, 3, true));
        let contents: Vec<_> = request.rows.iter().map(|r| r.content.as_str()).collect();
        assert_eq!(contents, ["row 3", "row 4", "row 5"]);
        assert_eq!(outbox.delivered_log(&request, &ack(6)), Logged::Progress);
        assert!(outbox.is_empty());
    }

    /// DESIGN invariant 19: the result goes after the rows, and a later heartbeat never
    /// replaces it (the first result wins).
    #[test]
    fn the_final_state_waits_for_the_rows_and_is_never_replaced() {
        let mut outbox = Outbox::default();
        outbox.hold_log(&log(0, rows(0, 2), true));
        let answer = outbox.hold_state(state(pb::TaskResult::RESULT_SUCCESS, &[("k", "1")]));
        assert_eq!(result_of(&answer), pb::TaskResult::RESULT_SUCCESS);
        assert_eq!(answer.sent_outputs, ["k"]);
        outbox.hold_state(state(
            pb::TaskResult::RESULT_UNSPECIFIED,
            &[("k", "2"), ("j", "3")],
        ));
        assert!(matches!(outbox.next(), Some(Delivery::Log { .. })));
        let Some(Delivery::Log { request, .. }) = outbox.next() else {
            unreachable!()
        };
        outbox.delivered_log(&request, &ack(2));
        let Some(Delivery::State {
            request,
            generation,
        }) = outbox.next()
        else {
            panic!("then the state")
        };
        assert_eq!(
            request.state.as_option().unwrap().result.as_known(),
            Some(pb::TaskResult::RESULT_SUCCESS)
        );
        assert_eq!(request.outputs.get("k").map(String::as_str), Some("1"));
        assert_eq!(request.outputs.get("j").map(String::as_str), Some("3"));
        outbox.delivered_state(generation, &pb::UpdateTaskResponse::default());
        assert!(outbox.is_empty());
    }

    /// DESIGN invariant 19: a local answer never invents a cancel, and repeats Gitea's.
    #[test]
    fn a_local_answer_repeats_giteas_cancel_and_never_invents_one() {
        let mut outbox = Outbox::default();
        let answer = outbox.hold_state(state(pb::TaskResult::RESULT_UNSPECIFIED, &[]));
        assert_eq!(result_of(&answer), pb::TaskResult::RESULT_UNSPECIFIED);
        let Some(Delivery::State { generation, .. }) = outbox.next() else {
            panic!()
        };
        outbox.delivered_state(
            generation,
            &pb::UpdateTaskResponse {
                state: MessageField::some(pb::TaskState {
                    id: 7,
                    result: pb::TaskResult::RESULT_CANCELLED.into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
        );
        let answer = outbox.hold_state(state(pb::TaskResult::RESULT_UNSPECIFIED, &[]));
        assert_eq!(result_of(&answer), pb::TaskResult::RESULT_CANCELLED);
    }

    /// A state that changed while its delivery was under way stays held.
    #[test]
    fn a_state_newer_than_the_delivered_one_stays_held() {
        let mut outbox = Outbox::default();
        outbox.hold_state(state(pb::TaskResult::RESULT_UNSPECIFIED, &[]));
        let Some(Delivery::State { generation, .. }) = outbox.next() else {
            panic!()
        };
        outbox.hold_state(state(pb::TaskResult::RESULT_FAILURE, &[]));
        outbox.delivered_state(generation, &pb::UpdateTaskResponse::default());
        assert!(!outbox.is_empty());
    }

    fn big_rows(from: usize, n: usize, size: usize) -> Vec<pb::LogRow> {
        (from..from + n)
            .map(|i| pb::LogRow {
                content: format!("row {i} {}", "x".repeat(size)),
                ..Default::default()
            })
            .collect()
    }

    fn next_log(outbox: &Outbox) -> pb::UpdateLogRequest {
        match outbox.next() {
            Some(Delivery::Log { request, .. }) => request,
            other => panic!("a log delivery, not {other:?}"),
        }
    }

    /// DESIGN invariant 19: a delivery fits the facade's request limit, and a batch the
    /// facade still finds too large is split until it fits; a single row cannot be split.
    #[test]
    fn deliveries_fit_the_facades_request_limit_and_a_too_large_answer_splits_them() {
        let mut outbox = Outbox::default();
        outbox.hold_log(&log(0, big_rows(0, 10, 1024 * 1024), true));
        let first = next_log(&outbox);
        let size = usize::try_from(first.encoded_len()).unwrap();
        assert!(size <= FACADE_REQUEST_LIMIT, "{size} bytes");
        assert_eq!(first.rows.len(), 3, "as many 1 MiB rows as fit in 4 MiB");
        assert!(!first.no_more, "no_more goes with the last rows only");
        // A proxy in front of the facade takes less: 413 for the batch.
        assert!(outbox.too_large(&first, size));
        let smaller = next_log(&outbox);
        assert_eq!((smaller.index, smaller.rows.len()), (0, 1));
        assert!(
            !outbox.too_large(&smaller, size / 2),
            "one row cannot be split"
        );
        assert_eq!(outbox.delivered_log(&smaller, &ack(1)), Logged::Progress);
        assert_eq!(
            next_log(&outbox).index,
            1,
            "the next batch starts at Gitea's index"
        );
    }

    /// DESIGN invariant 19: a batch refused for good is dropped alone; the rows after it
    /// take its place in Gitea's log, and the runner's index, which counted the dropped
    /// rows, is translated from then on (held or sent through), so its log goes on.
    #[test]
    fn a_refused_batch_is_dropped_alone_and_the_runners_index_is_translated_from_then_on() {
        let mut outbox = Outbox::default();
        outbox.passed_log(&log(0, rows(0, 2), false), &ack(2));
        assert_eq!(
            outbox
                .hold_log(&log(2, big_rows(2, 4, 1024 * 1024), false))
                .ack_index,
            6
        );
        let first = next_log(&outbox);
        assert_eq!(first.rows.len(), 3);
        assert_eq!(
            outbox.refuse_log(&first),
            RefusedRows { first: 2, count: 3 }
        );
        let rest = next_log(&outbox);
        assert_eq!((rest.index, rest.rows.len()), (2, 1), "at Gitea's index");
        assert!(rest.rows[0].content.starts_with("row 5 "));
        // The runner goes on at its own index while the last row is still held.
        assert_eq!(outbox.hold_log(&log(6, rows(6, 1), true)).ack_index, 7);
        assert_eq!(outbox.delivered_log(&rest, &ack(3)), Logged::Progress);
        let last = next_log(&outbox);
        assert_eq!((last.index, last.no_more), (3, true));
        assert_eq!(last.rows[0].content, "row 6");
        assert_eq!(outbox.delivered_log(&last, &ack(4)), Logged::Progress);
        assert!(outbox.is_empty());
        // Sent through: the runner's index 7 is Gitea's 4, Gitea's answer is the runner's.
        let mut sent = log(7, rows(7, 1), false);
        assert!(outbox.to_gitea(&mut sent));
        assert_eq!(sent.index, 4);
        let mut answer = ack(5);
        outbox.passed_log(&sent, &answer);
        outbox.to_runner(&mut answer);
        assert_eq!(answer.ack_index, 8);
    }

    /// A final state whose steps' logs span `ranges` (runner's index, length).
    fn state_with_steps(ranges: &[(i64, i64)]) -> pb::UpdateTaskRequest {
        let mut request = state(pb::TaskResult::RESULT_SUCCESS, &[]);
        request.state.as_option_mut().unwrap().steps = ranges
            .iter()
            .map(|&(log_index, log_length)| pb::StepState {
                log_index,
                log_length,
                ..Default::default()
            })
            .collect();
        request
    }

    fn step_ranges(request: &pb::UpdateTaskRequest) -> Vec<(i64, i64)> {
        request
            .state
            .as_option()
            .unwrap()
            .steps
            .iter()
            .map(|s| (s.log_index, s.log_length))
            .collect()
    }

    /// DESIGN invariant 19 (issue 37): after rows were refused for good, the steps' log
    /// ranges in the runner's `UpdateTask` are translated into Gitea's index as the log's
    /// index is, held or sent through, so Gitea slices each step's log from its own rows: a
    /// step before the dropped rows keeps its range, one spanning them loses them, one
    /// after them moves up.
    #[test]
    fn after_a_refused_batch_the_steps_log_ranges_are_translated_like_the_logs_index() {
        let mut outbox = Outbox::default();
        outbox.passed_log(&log(0, rows(0, 2), false), &ack(2));
        outbox.hold_log(&log(2, big_rows(2, 4, 1024 * 1024), false));
        let first = next_log(&outbox);
        assert_eq!(
            outbox.refuse_log(&first),
            RefusedRows { first: 2, count: 3 }
        );
        // Steps: rows 0–1, rows 1–5 (spanning the dropped 2–4), rows 6–7.
        outbox.hold_state(state_with_steps(&[(0, 2), (1, 5), (6, 2)]));
        let rest = next_log(&outbox);
        assert_eq!(outbox.delivered_log(&rest, &ack(3)), Logged::Progress);
        let Some(Delivery::State { request, .. }) = outbox.next() else {
            panic!("the state is delivered next");
        };
        assert_eq!(step_ranges(&request), vec![(0, 2), (1, 2), (3, 2)]);

        // Sent through once nothing is held: translated the same way.
        let mut sent = state_with_steps(&[(6, 2)]);
        assert!(outbox.to_gitea_state(&mut sent));
        assert_eq!(step_ranges(&sent), vec![(3, 2)]);
    }

    /// DESIGN invariant 19 (issue 37): rows Gitea turned out not to have (it acknowledged
    /// fewer than the runner was told) shift the steps' log ranges as they shift the log.
    #[test]
    fn after_a_re_base_the_steps_log_ranges_follow_giteas_index() {
        let mut outbox = Outbox::default();
        outbox.hold_log(&log(5, rows(5, 2), false));
        let first = next_log(&outbox);
        assert_eq!(
            outbox.delivered_log(&first, &ack(3)),
            Logged::Behind { lost: 2 }
        );
        let mut sent = state_with_steps(&[(5, 2)]);
        assert!(outbox.to_gitea_state(&mut sent));
        assert_eq!(step_ranges(&sent), vec![(3, 2)]);
    }

    /// DESIGN invariant 19: when Gitea has fewer rows than the runner was told (an
    /// acknowledgement adopted from the runner was wrong), the held rows go on at Gitea's
    /// index and the loss is reported, not the held rows dropped.
    #[test]
    fn held_rows_go_on_at_giteas_index_when_gitea_has_fewer_than_the_runner_was_told() {
        let mut outbox = Outbox::default();
        assert_eq!(outbox.hold_log(&log(5, rows(5, 2), false)).ack_index, 7);
        let first = next_log(&outbox);
        assert_eq!(first.index, 5);
        assert_eq!(
            outbox.delivered_log(&first, &ack(3)),
            Logged::Behind { lost: 2 }
        );
        let again = next_log(&outbox);
        assert_eq!((again.index, again.rows.len()), (3, 2));
        assert_eq!(outbox.delivered_log(&again, &ack(5)), Logged::Progress);
        assert!(outbox.is_empty());
        assert_eq!(outbox.hold_log(&log(7, rows(7, 1), false)).ack_index, 8);
    }

    /// Memory is bounded: rows beyond the cap are not acknowledged, so the runner keeps them.
    #[test]
    fn rows_beyond_the_memory_bound_are_left_with_the_runner() {
        let mut outbox = Outbox::default();
        let big = "x".repeat(MAX_HELD_BYTES / 2 + 1);
        let request = log(
            0,
            vec![
                pb::LogRow {
                    content: big.clone(),
                    ..Default::default()
                },
                pb::LogRow {
                    content: big,
                    ..Default::default()
                },
            ],
            true,
        );
        assert_eq!(outbox.hold_log(&request).ack_index, 1);
        assert!(!outbox.no_more, "no_more only once every row is held");
    }
}
