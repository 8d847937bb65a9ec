//! Watch streams: `GET …?watch=true`, newline-delimited `{"type", "object"}` events.
//!
//! A watch from resourceVersion `R` replays the recorded changes after `R`, then follows
//! live ones; without `R` (or with `"0"`) it starts with a synthetic `ADDED` for every
//! matching object. A watch whose `R` is older than the compacted history, or that is open
//! when [`super::FakeKube::expire_watches`] runs, receives one `ERROR` event carrying a
//! `410 Expired` Status and ends, as the real server does in a `200` stream. Bookmarks are
//! sent only when the client asked (`allowWatchBookmarks=true`): on demand
//! ([`super::FakeKube::send_bookmarks`]) and, as the real server's watch cache sends them,
//! every minute and once 2 s before the watch's `timeoutSeconds` deadline, so that a client
//! learns the current resourceVersion before its watch ends. `timeoutSeconds` ends the
//! stream cleanly.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::{
    FakeKube, FieldSelector, LabelSelector, ResourceType, Store, Target, bad_request, selectors,
    status_body,
};

struct WatchState {
    kube: FakeKube,
    rt: ResourceType,
    type_key: String,
    namespace: Option<String>,
    labels: Option<LabelSelector>,
    fields: Option<FieldSelector>,
    cursor: u64,
    bookmarks: bool,
    bookmarks_seen: u64,
    expiry_seen: u64,
    deadline: Option<Instant>,
    /// When the next periodic BOOKMARK is due (`None` without `allowWatchBookmarks`).
    next_bookmark: Option<Instant>,
    rx: tokio::sync::watch::Receiver<u64>,
    pending: VecDeque<Value>,
    done: bool,
}

impl WatchState {
    fn matches(&self, obj: &Value) -> bool {
        self.labels.as_ref().is_none_or(|s| s.matches(obj))
            && self.fields.as_ref().is_none_or(|s| s.matches(obj))
    }

    /// Queues what happened since `cursor`; called with the store locked.
    fn collect(&mut self, s: &Store) {
        if s.expiry != self.expiry_seen || self.cursor < s.oldest {
            self.pending.push_back(expired(self.cursor, s.revision));
            self.done = true;
            return;
        }
        for change in s.changes.iter().filter(|c| c.rv > self.cursor) {
            if change.type_key != self.type_key
                || self
                    .namespace
                    .as_ref()
                    .is_some_and(|ns| *ns != change.namespace)
            {
                continue;
            }
            let was = change.old.as_ref().is_some_and(|o| self.matches(o));
            let event = match &change.new {
                Some(new) => match (was, self.matches(new)) {
                    (false, true) => Some(("ADDED", new.clone())),
                    (true, true) => Some(("MODIFIED", new.clone())),
                    // No longer selected: the watcher must forget it.
                    (true, false) => Some(("DELETED", new.clone())),
                    (false, false) => None,
                },
                None if was => change.old.clone().map(|mut old| {
                    old["metadata"]["resourceVersion"] = change.rv.to_string().into();
                    ("DELETED", old)
                }),
                None => None,
            };
            if let Some((kind, object)) = event {
                self.pending
                    .push_back(json!({ "type": kind, "object": object }));
            }
        }
        self.cursor = s.revision;
        if self.bookmarks && s.bookmarks != self.bookmarks_seen {
            self.bookmarks_seen = s.bookmarks;
            self.bookmark();
        }
    }

    /// Queues a BOOKMARK carrying the current resourceVersion.
    fn bookmark(&mut self) {
        self.pending.push_back(json!({
            "type": "BOOKMARK",
            "object": {
                "kind": self.rt.kind,
                "apiVersion": self.rt.api_version(),
                "metadata": { "resourceVersion": self.cursor.to_string() },
            },
        }));
    }
}

/// How often the real server's watch cache sends a BOOKMARK to a watch that allows them.
const BOOKMARK_EVERY: Duration = Duration::from_secs(60);
/// How long before a watch's deadline the real server sends its last BOOKMARK.
const BOOKMARK_BEFORE_DEADLINE: Duration = Duration::from_secs(2);

/// When the next periodic BOOKMARK is due after `now`: a minute on, or 2 s before the
/// deadline when that comes first; `None` once that moment has passed (the watch ends
/// before another one).
fn next_bookmark(now: Instant, deadline: Option<Instant>) -> Option<Instant> {
    let periodic = now + BOOKMARK_EVERY;
    match deadline.and_then(|d| d.checked_sub(BOOKMARK_BEFORE_DEADLINE)) {
        Some(last) if last < periodic => (last > now).then_some(last),
        _ => Some(periodic),
    }
}

impl Drop for WatchState {
    fn drop(&mut self) {
        let mut s = self.kube.lock();
        s.open_watches = s.open_watches.saturating_sub(1);
    }
}

fn expired(asked: u64, current: u64) -> Value {
    json!({
        "type": "ERROR",
        "object": status_body(
            StatusCode::GONE,
            "Expired",
            &format!("too old resource version: {asked} ({current})"),
            None,
        ),
    })
}

fn line(event: &Value) -> Bytes {
    let mut bytes = serde_json::to_vec(event).unwrap_or_default();
    bytes.push(b'\n');
    Bytes::from(bytes)
}

/// Starts a watch; called with the store locked (the stream locks it again per step).
pub(super) fn start(
    kube: &FakeKube,
    s: &mut Store,
    t: &Target,
    params: &BTreeMap<String, String>,
) -> Response {
    let (labels, fields) = match selectors(params) {
        Ok(sel) => sel,
        Err(r) => return *r,
    };
    let from = match params.get("resourceVersion").map(String::as_str) {
        None | Some("") | Some("0") => None,
        Some(rv) => match rv.parse::<u64>() {
            Ok(rv) => Some(rv),
            Err(_) => return bad_request(&format!("invalid resource version {rv:?}")),
        },
    };
    let deadline = params
        .get("timeoutSeconds")
        .and_then(|v| v.parse::<u64>().ok())
        .map(|secs| Instant::now() + Duration::from_secs(secs));
    let bookmarks = params
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true");
    let mut state = WatchState {
        kube: kube.clone(),
        rt: t.rt.clone(),
        type_key: t.rt.key(),
        namespace: t.namespace.clone(),
        labels,
        fields,
        cursor: from.unwrap_or(s.revision),
        bookmarks,
        bookmarks_seen: s.bookmarks,
        expiry_seen: s.expiry,
        deadline,
        next_bookmark: if bookmarks {
            next_bookmark(Instant::now(), deadline)
        } else {
            None
        },
        rx: kube.changed.subscribe(),
        pending: VecDeque::new(),
        done: false,
    };
    if from.is_none() {
        // "Start at most recent": the current state as synthetic ADDED events.
        let current: Vec<Value> = s
            .objects
            .iter()
            .filter(|((k, ns, _), _)| {
                *k == state.type_key && state.namespace.as_ref().is_none_or(|want| want == ns)
            })
            .filter(|(_, v)| state.matches(v))
            .map(|(_, v)| v.clone())
            .collect();
        for object in current {
            state
                .pending
                .push_back(json!({ "type": "ADDED", "object": object }));
        }
    }
    s.open_watches += 1;
    let stream = futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(event) = st.pending.pop_front() {
                return Some((Ok::<_, std::io::Error>(line(&event)), st));
            }
            if st.done {
                return None;
            }
            st.rx.borrow_and_update();
            {
                let kube = st.kube.clone();
                let s = kube.lock();
                st.collect(&s);
            }
            if !st.pending.is_empty() {
                continue;
            }
            let deadline = st.deadline;
            let timed_out = async move {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            let due = st.next_bookmark;
            let bookmark_due = async move {
                match due {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                changed = st.rx.changed() => if changed.is_err() { return None },
                _ = timed_out => return None,
                () = bookmark_due => {
                    st.bookmark();
                    st.next_bookmark = next_bookmark(Instant::now(), st.deadline);
                }
            }
        }
    });
    (
        StatusCode::OK,
        [(http::header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bookmark_is_due_every_minute_and_last_two_seconds_before_the_deadline() {
        let now = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(next_bookmark(now, None), Some(now + s(60)));
        assert_eq!(next_bookmark(now, Some(now + s(120))), Some(now + s(60)));
        assert_eq!(next_bookmark(now, Some(now + s(5))), Some(now + s(3)));
        // Past the last moment: no other bookmark before the watch ends.
        assert_eq!(next_bookmark(now, Some(now + s(1))), None);
        assert_eq!(next_bookmark(now + s(3), Some(now + s(5))), None);
    }
}
