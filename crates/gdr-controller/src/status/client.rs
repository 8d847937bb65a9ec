//! `gitea-dynamic-runner status`: reads `/status` from a controller's health listener.

use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::StatusReport;

/// How long the command waits for the controller.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Why the status could not be read.
#[derive(Debug, thiserror::Error)]
pub enum StatusClientError {
    /// The URL cannot be parsed.
    #[error("{url} is not a usable http:// URL of the health listener: {source}")]
    Unparsable {
        /// What was given.
        url: String,
        /// Why.
        #[source]
        source: http::uri::InvalidUri,
    },
    /// The URL is not an `http://` URL.
    #[error("{url} is not a usable http:// URL of the health listener: {reason}")]
    Url {
        /// What was given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The controller could not be reached.
    #[error("cannot reach {url}: {detail}")]
    Request {
        /// The status URL.
        url: String,
        /// The cause and its causes (the client's own message alone says little).
        detail: String,
        /// Why.
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    /// The answer's body could not be read.
    #[error("reading the answer of {url}: {source}")]
    Body {
        /// The status URL.
        url: String,
        /// Why.
        #[source]
        source: hyper::Error,
    },
    /// The controller did not answer in time.
    #[error("{url} did not answer within {secs} s", secs = TIMEOUT.as_secs())]
    Timeout {
        /// The status URL.
        url: String,
    },
    /// The controller answered with an error status.
    #[error("{url} answered {status}")]
    Status {
        /// The status URL.
        url: String,
        /// The HTTP status.
        status: http::StatusCode,
    },
    /// The answer is not a status document (another server on that port, another version).
    #[error("{url} did not answer with a status document: {source}")]
    Decode {
        /// The status URL.
        url: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
}

/// An error and every cause under it, `: `-separated.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// The `/status` URL under a health listener's base URL.
pub fn status_url(base: &str) -> Result<http::Uri, StatusClientError> {
    let url = format!("{}/status", base.trim_end_matches('/'));
    let uri: http::Uri = url
        .parse()
        .map_err(|source| StatusClientError::Unparsable {
            url: base.to_owned(),
            source,
        })?;
    if uri.scheme_str() != Some("http") {
        return Err(StatusClientError::Url {
            url: base.to_owned(),
            reason: "the health listener speaks plain http".into(),
        });
    }
    Ok(uri)
}

/// Reads the status document from the health listener at `base` (e.g. `http://127.0.0.1:9090`).
pub async fn fetch(base: &str) -> Result<StatusReport, StatusClientError> {
    let uri = status_url(base)?;
    let url = uri.to_string();
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
    let exchange = async {
        let response = client
            .get(uri)
            .await
            .map_err(|source| StatusClientError::Request {
                url: url.clone(),
                detail: chain(&source),
                source,
            })?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|source| StatusClientError::Body {
                url: url.clone(),
                source,
            })?
            .to_bytes();
        if !status.is_success() {
            return Err(StatusClientError::Status {
                url: url.clone(),
                status,
            });
        }
        serde_json::from_slice(&body).map_err(|source| StatusClientError::Decode {
            url: url.clone(),
            source,
        })
    };
    tokio::time::timeout(TIMEOUT, exchange)
        .await
        .map_err(|_| StatusClientError::Timeout { url: url.clone() })?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_http_urls_of_the_health_listener_are_accepted() {
        assert_eq!(
            status_url("http://127.0.0.1:9090/").unwrap().to_string(),
            "http://127.0.0.1:9090/status"
        );
        assert!(matches!(
            status_url("https://127.0.0.1:9090"),
            Err(StatusClientError::Url { .. })
        ));
        // Issue 41 item 3: the parser's error stays the cause, not a string of it.
        let e = status_url("not a url").unwrap_err();
        assert!(matches!(e, StatusClientError::Unparsable { .. }), "{e:?}");
        assert!(std::error::Error::source(&e).is_some(), "{e:?}");
        assert!(
            e.to_string()
                .starts_with("not a url is not a usable http:// URL"),
            "{e}"
        );
    }
}
