//! Typed errors for calls to Gitea.
//!
//! Gitea answers almost every failure as HTTP 500 with Connect code `unknown`
//! and a gRPC-status text, `rpc error: code = Unauthenticated desc = unregistered
//! runner`, because its handlers return grpc `status` errors that connect-go does
//! not recognise. A proxy in front of Gitea answers with real Connect/HTTP codes.
//! Both shapes map to one [`ErrorKind`] so callers can branch on the cause.

use std::fmt;

use connectrpc::{ConnectError, ErrorCode, SharedSource};

/// What kind of failure a Gitea call met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The runner UUID/token or the registration token was refused.
    Unauthenticated,
    /// The runner, task or object does not exist (e.g. removed ephemeral runner).
    NotFound,
    /// Gitea refused the request's content (bad argument, wrong runner for a
    /// task, archived log).
    Invalid,
    /// Gitea or the network is unavailable, overloaded, or the call timed out;
    /// retrying later may succeed.
    Unavailable,
    /// Gitea's answer is larger than this client reads (see
    /// [`crate::FETCH_TASK_MESSAGE_LIMIT`]): not an outage, and retrying does not
    /// help.
    TooLarge,
    /// Anything else, including Gitea internal errors.
    Other,
}

impl ErrorKind {
    /// Metric/log label.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Unauthenticated => "unauthenticated",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Invalid => "invalid",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::Other => "other",
        }
    }
}

/// A failed call to Gitea (or a client that could not be built).
#[derive(Debug, Clone)]
pub struct GiteaError {
    kind: ErrorKind,
    /// The RPC, e.g. `FetchTask`; `None` for configuration errors.
    method: Option<&'static str>,
    /// Gitea's own text (the gRPC `desc`), or the transport's; for a configuration error
    /// what could not be built.
    message: String,
    /// The code Gitea's message carried (`Unauthenticated`), or the Connect code.
    code: String,
    /// The cause under it (the transport's error, an unparsable URL, a bad CA file),
    /// shared so that the error stays `Clone`.
    source: Option<SharedSource>,
}

impl std::error::Error for GiteaError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl fmt::Display for GiteaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            ErrorKind::Unauthenticated => "Gitea refused the credentials",
            ErrorKind::NotFound => "Gitea does not know the object",
            ErrorKind::Invalid => "Gitea refused the request",
            ErrorKind::Unavailable => "Gitea is unavailable",
            ErrorKind::TooLarge => "Gitea's answer is larger than the client accepts",
            ErrorKind::Other => "Gitea call failed",
        };
        // A call's message already holds its transport cause's text (connectrpc writes it
        // there); a configuration error's does not.
        match (self.method, &self.source) {
            (Some(m), _) => write!(f, "{m}: {what} ({}): {}", self.code, self.message),
            (None, Some(cause)) => write!(f, "{}: {cause}", self.message),
            (None, None) => write!(f, "{}", self.message),
        }
    }
}

impl GiteaError {
    /// The kind callers branch on.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Gitea's message text.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether a retry later may succeed.
    pub fn is_retryable(&self) -> bool {
        self.kind == ErrorKind::Unavailable
    }

    /// The call ran into the client's own deadline (or a proxy's 408): for a FetchTask
    /// that Gitea holds open until a task arrives, the normal end of an idle poll.
    pub fn timed_out(&self) -> bool {
        self.code == ErrorCode::DeadlineExceeded.as_str()
    }

    /// Gitea itself says it no longer has this task for this runner: the task does not
    /// exist (any more), or it belongs to another runner. Real Gitea answers both as
    /// `Internal` with `update task: resource does not exist` (`get task: …` from UpdateLog)
    /// and `update task: invalid runner for task`; a proxy or a newer Gitea may answer
    /// `NotFound`. A plain HTTP 404 (wrong URL, Actions disabled) does not count, so a
    /// misconfiguration never makes the controller treat running jobs as gone.
    pub fn task_gone(&self) -> bool {
        const GONE: [&str; 2] = ["resource does not exist", "invalid runner for task"];
        match self.kind {
            ErrorKind::NotFound => self.code == "NotFound",
            ErrorKind::Other => {
                matches!(self.code.as_str(), "Internal" | "Unknown")
                    && matches!(self.method, Some("UpdateTask" | "UpdateLog"))
                    && GONE.iter().any(|g| self.message.ends_with(g))
            }
            _ => false,
        }
    }

    /// A client (or the facade's reverse proxy to Gitea) that could not be built, for a
    /// reason of our own.
    pub fn config(message: String) -> Self {
        GiteaError {
            kind: ErrorKind::Other,
            method: None,
            message,
            code: "config".into(),
            source: None,
        }
    }

    /// A client (or the facade's reverse proxy to Gitea) that could not be built because
    /// of `cause`; `context` says what was being built from what.
    pub fn config_caused(
        context: String,
        cause: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        GiteaError {
            source: Some(SharedSource::from(cause.into())),
            ..Self::config(context)
        }
    }

    pub(crate) fn protocol(method: &'static str, message: &str) -> Self {
        GiteaError {
            kind: ErrorKind::Other,
            method: Some(method),
            message: message.to_string(),
            code: "protocol".into(),
            source: None,
        }
    }

    /// Classifies a Connect error, decoding Gitea's `rpc error: …` text.
    pub fn from_connect(method: &'static str, error: ConnectError) -> Self {
        let raw = error.message.clone().unwrap_or_default();
        let source = error.source_arc();
        if let Some((grpc_code, desc)) = parse_grpc_status_text(&raw) {
            return GiteaError {
                kind: kind_of_grpc_name(grpc_code),
                method: Some(method),
                message: desc.to_string(),
                code: grpc_code.to_string(),
                source,
            };
        }
        // The client's own bound on a response (`message size N exceeds limit M`): the
        // answer arrived whole, it is just larger than we read.
        if error.code == ErrorCode::ResourceExhausted && raw.contains("exceeds limit") {
            return GiteaError {
                kind: ErrorKind::TooLarge,
                method: Some(method),
                message: raw,
                code: error.code.as_str().to_string(),
                source,
            };
        }
        let kind = match error.code {
            ErrorCode::Unauthenticated | ErrorCode::PermissionDenied => ErrorKind::Unauthenticated,
            ErrorCode::NotFound => ErrorKind::NotFound,
            ErrorCode::InvalidArgument
            | ErrorCode::FailedPrecondition
            | ErrorCode::OutOfRange
            | ErrorCode::AlreadyExists => ErrorKind::Invalid,
            ErrorCode::Unavailable
            | ErrorCode::DeadlineExceeded
            | ErrorCode::ResourceExhausted
            | ErrorCode::Aborted
            | ErrorCode::Canceled => ErrorKind::Unavailable,
            // A Gitea without the runner API (Actions disabled) answers 404, which
            // connect-go reads as unimplemented.
            ErrorCode::Unimplemented => ErrorKind::NotFound,
            _ => ErrorKind::Other,
        };
        let message = if raw.is_empty() {
            format!("HTTP {}", error.http_status())
        } else {
            raw
        };
        GiteaError {
            kind,
            method: Some(method),
            message,
            code: error.code.as_str().to_string(),
            source,
        }
    }
}

/// Splits `rpc error: code = <Name> desc = <text>` into `(Name, text)`.
fn parse_grpc_status_text(message: &str) -> Option<(&str, &str)> {
    let rest = message.trim_start().strip_prefix("rpc error: code = ")?;
    let (code, desc) = rest.split_once(" desc = ")?;
    let code = code.trim();
    (!code.is_empty() && code.chars().all(|c| c.is_ascii_alphanumeric())).then_some((code, desc))
}

fn kind_of_grpc_name(name: &str) -> ErrorKind {
    match name {
        "Unauthenticated" | "PermissionDenied" => ErrorKind::Unauthenticated,
        "NotFound" => ErrorKind::NotFound,
        "InvalidArgument" | "FailedPrecondition" | "OutOfRange" | "AlreadyExists" => {
            ErrorKind::Invalid
        }
        "Unavailable" | "DeadlineExceeded" | "ResourceExhausted" | "Aborted" | "Canceled" => {
            ErrorKind::Unavailable
        }
        _ => ErrorKind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gitea_grpc_status_text_becomes_a_typed_kind_with_its_description() {
        let e = GiteaError::from_connect(
            "FetchTask",
            ConnectError::new(
                ErrorCode::Unknown,
                "rpc error: code = Unauthenticated desc = unregistered runner",
            ),
        );
        assert_eq!(e.kind(), ErrorKind::Unauthenticated);
        assert_eq!(e.message(), "unregistered runner");
        assert_eq!(
            e.to_string(),
            "FetchTask: Gitea refused the credentials (Unauthenticated): unregistered runner"
        );
    }

    #[test]
    fn a_transport_failure_keeps_its_cause_under_the_classified_error() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let e = GiteaError::from_connect(
            "FetchTask",
            ConnectError::unavailable_from_transport("connect", refused),
        );
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        let cause = std::error::Error::source(&e).expect("the transport's error is the cause");
        let io = cause
            .downcast_ref::<std::io::Error>()
            .expect("an io::Error");
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
        assert_eq!(e.clone().to_string(), e.to_string());
    }

    #[test]
    fn a_configuration_error_keeps_its_cause_and_names_it() {
        let bad = "http://[::1".parse::<url::Url>().unwrap_err();
        let e = GiteaError::config_caused("Gitea URL \"http://[::1\" is invalid".into(), bad);
        let cause = std::error::Error::source(&e).expect("the parser's error is the cause");
        assert_eq!(cause.downcast_ref::<url::ParseError>(), Some(&bad));
        assert_eq!(
            e.to_string(),
            format!("Gitea URL \"http://[::1\" is invalid: {bad}")
        );
        assert!(std::error::Error::source(&GiteaError::config("no cause".into())).is_none());
    }

    #[test]
    fn a_plain_unknown_error_stays_other_and_keeps_its_text() {
        let e = GiteaError::from_connect(
            "UpdateTask",
            ConnectError::new(ErrorCode::Unknown, "runner has been removed"),
        );
        assert_eq!(e.kind(), ErrorKind::Other);
        assert!(e.to_string().contains("runner has been removed"));
    }

    #[test]
    fn real_connect_codes_from_a_proxy_are_classified_too() {
        for (code, kind) in [
            (ErrorCode::Unauthenticated, ErrorKind::Unauthenticated),
            (ErrorCode::Unavailable, ErrorKind::Unavailable),
            (ErrorCode::DeadlineExceeded, ErrorKind::Unavailable),
            (ErrorCode::NotFound, ErrorKind::NotFound),
            (ErrorCode::Unimplemented, ErrorKind::NotFound),
            (ErrorCode::InvalidArgument, ErrorKind::Invalid),
            (ErrorCode::Internal, ErrorKind::Other),
        ] {
            assert_eq!(
                GiteaError::from_connect("Declare", ConnectError::new(code, "x")).kind(),
                kind,
                "{code:?}"
            );
        }
    }

    /// What real Gitea answers when the controller fails a task it no longer has counts as
    /// gone (so the executor is cleaned up and its slot released instead of a report
    /// retried forever); other failures, and an HTTP 404 of a misconfigured URL, do not.
    #[test]
    fn the_answers_gitea_gives_for_a_task_it_no_longer_has_count_as_gone() {
        let gitea = |method, text: &str| {
            GiteaError::from_connect(method, ConnectError::new(ErrorCode::Unknown, text))
        };
        for (method, text) in [
            (
                "UpdateTask",
                "rpc error: code = Internal desc = update task: resource does not exist",
            ),
            (
                "UpdateTask",
                "rpc error: code = Internal desc = update task: failed to get task 7: resource does not exist",
            ),
            (
                "UpdateTask",
                "rpc error: code = Internal desc = update task: invalid runner for task",
            ),
            (
                "UpdateLog",
                "rpc error: code = Internal desc = get task: resource does not exist",
            ),
            (
                "UpdateTask",
                "rpc error: code = NotFound desc = task 7 does not exist",
            ),
        ] {
            assert!(gitea(method, text).task_gone(), "{method}: {text}");
        }
        for (method, text) in [
            (
                "UpdateTask",
                "rpc error: code = Internal desc = update task: database is locked",
            ),
            (
                "UpdateTask",
                "rpc error: code = Unauthenticated desc = unregistered runner",
            ),
            (
                "FetchTask",
                "rpc error: code = Internal desc = pick task: resource does not exist",
            ),
        ] {
            assert!(!gitea(method, text).task_gone(), "{method}: {text}");
        }
        let http_404 = GiteaError::from_connect(
            "UpdateTask",
            ConnectError::new(ErrorCode::Unimplemented, "HTTP 404"),
        );
        assert!(!http_404.task_gone());
    }

    #[test]
    fn an_answer_over_the_clients_limit_is_too_large_not_an_outage() {
        let e = GiteaError::from_connect(
            "FetchTask",
            ConnectError::new(
                ErrorCode::ResourceExhausted,
                "message size 40000000 exceeds limit 33554432",
            ),
        );
        assert_eq!(e.kind(), ErrorKind::TooLarge);
        assert!(!e.is_retryable());
        let text = e.to_string();
        assert!(text.contains("larger than the client accepts"), "{text}");
        assert!(text.contains("40000000"), "{text}");
        let throttled = GiteaError::from_connect(
            "FetchTask",
            ConnectError::new(ErrorCode::ResourceExhausted, "HTTP 429"),
        );
        assert_eq!(throttled.kind(), ErrorKind::Unavailable);
    }

    #[test]
    fn malformed_status_texts_are_not_misread() {
        assert_eq!(parse_grpc_status_text("rpc error: code =  desc = x"), None);
        assert_eq!(
            parse_grpc_status_text("rpc error: code = Not Found desc = x"),
            None
        );
        assert_eq!(parse_grpc_status_text("something else"), None);
        assert_eq!(
            parse_grpc_status_text("rpc error: code = NotFound desc = "),
            Some(("NotFound", ""))
        );
    }
}
