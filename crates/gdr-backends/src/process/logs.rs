//! `executor.log`: the executor's last error quoted in a failure reason, and the logs of
//! deleted executors kept under `<state_root>/logs/` within their [`LogRetention`].

use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::{LOG_FILE, LOGS_DIR};

/// How much of the end of `executor.log` is searched for the executor's last error.
const ERROR_TAIL: u64 = 64 * 1024;
/// Longest error line quoted in a failure reason.
const MAX_ERROR_LINE: usize = 300;

/// Which logs of deleted executors are kept: none older than `max_age`, at most
/// `max_count` (the newest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogRetention {
    /// Age limit (zero: no log is kept).
    pub max_age: Duration,
    /// Count limit (zero: no log is kept).
    pub max_count: usize,
}

impl LogRetention {
    /// Keeps no log.
    pub const NONE: LogRetention = LogRetention {
        max_age: Duration::ZERO,
        max_count: 0,
    };

    pub(super) fn keeps_any(&self) -> bool {
        !self.max_age.is_zero() && self.max_count > 0
    }
}

/// The executor's own last error in `<dir>/executor.log`: the `error: …` line it prints
/// when it stops, or its last ERROR event. Lines of the runner (which shares the file) are
/// not quoted: only the executor's own messages, which never carry secrets (invariant 17).
pub(super) fn last_error_line(dir: &Path) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(dir.join(LOG_FILE)).ok()?;
    let len = file.metadata().ok()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(ERROR_TAIL)))
        .ok()?;
    let mut tail = Vec::new();
    file.take(ERROR_TAIL).read_to_end(&mut tail).ok()?;
    let text = String::from_utf8_lossy(&tail);
    let line = text.lines().rev().find_map(executor_error)?;
    Some(if line.chars().count() > MAX_ERROR_LINE {
        let cut: String = line.chars().take(MAX_ERROR_LINE).collect();
        format!("{cut}…")
    } else {
        line
    })
}

/// The message of one executor error line, if it is one.
fn executor_error(line: &str) -> Option<String> {
    if let Some(rest) = line.strip_prefix("error: ") {
        return Some(rest.trim().to_owned());
    }
    let event: serde_json::Value = serde_json::from_str(line).ok()?;
    let ours = event
        .get("target")
        .and_then(|t| t.as_str())
        .is_some_and(|t| t.starts_with("gdr_executor"));
    if !ours || event.get("level").and_then(|l| l.as_str()) != Some("ERROR") {
        return None;
    }
    let message = event.get("message")?.as_str()?;
    Some(match event.get("error").and_then(|e| e.as_str()) {
        Some(error) => format!("{message}: {error}"),
        None => message.to_owned(),
    })
}

/// Moves a deleted executor's log to `logs/`, then drops kept logs beyond the retention.
pub(super) fn keep_log(
    root: &Path,
    name: &str,
    dir: &Path,
    retention: LogRetention,
) -> io::Result<()> {
    let logs = root.join(LOGS_DIR);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&logs)?;
    match std::fs::rename(dir.join(LOG_FILE), logs.join(format!("{name}.log"))) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    prune_logs(&logs, retention, SystemTime::now())
}

/// Removes kept logs older than the retention, then the oldest beyond its count.
fn prune_logs(logs: &Path, retention: LogRetention, now: SystemTime) -> io::Result<()> {
    let mut kept: Vec<(SystemTime, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(logs)? {
        let entry = entry?;
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "log") {
            continue;
        }
        let modified = entry.metadata()?.modified()?;
        let age = now.duration_since(modified).unwrap_or_default();
        if age > retention.max_age {
            std::fs::remove_file(&path)?;
        } else {
            kept.push((modified, path));
        }
    }
    kept.sort_by_key(|k| std::cmp::Reverse(k.0));
    for (_, path) in kept.into_iter().skip(retention.max_count) {
        std::fs::remove_file(path)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use gdr_core::executor::Phase;

    use super::super::finished;
    use super::*;

    /// The failure reason quotes the executor's own last error, never a runner line.
    #[test]
    fn the_last_error_line_is_the_executors_own() {
        let dir = tempfile::tempdir().expect("dir");
        let log = [
            r#"{"timestamp":"t","level":"ERROR","message":"first","target":"gdr_executor::relay"}"#,
            r#"{"timestamp":"t","level":"ERROR","message":"runner says: token=xyz","target":"runner"}"#,
            r#"{"timestamp":"t","level":"ERROR","message":"the facade stayed away","waited":"1s","error":"refused","target":"gdr_executor::relay"}"#,
            "some runner output",
        ]
        .join("\n");
        std::fs::write(dir.path().join(LOG_FILE), log).expect("write");
        assert_eq!(
            last_error_line(dir.path()).as_deref(),
            Some("the facade stayed away: refused")
        );
        std::fs::write(
            dir.path().join(LOG_FILE),
            "noise\nerror: gave up delivering the runner's reports\nmore runner output\n",
        )
        .expect("write");
        assert_eq!(
            last_error_line(dir.path()).as_deref(),
            Some("gave up delivering the runner's reports")
        );
        assert_eq!(
            finished(Some(1), Some("boom".into())),
            Phase::Finished {
                success: false,
                reason: Some("the executor exited with status 1; its last error: boom".into())
            }
        );
    }

    /// Kept logs never exceed the retention's age or count; the newest stay.
    #[test]
    fn kept_logs_are_pruned_by_age_and_count() {
        let dir = tempfile::tempdir().expect("dir");
        let now = SystemTime::now();
        for (i, age) in [10u64, 20, 30, 4000].iter().enumerate() {
            let path = dir.path().join(format!("gitea-task-{i}.log"));
            std::fs::write(&path, "x").expect("write");
            let file = std::fs::File::options()
                .write(true)
                .open(&path)
                .expect("open");
            file.set_modified(now - Duration::from_secs(*age))
                .expect("mtime");
        }
        let retention = LogRetention {
            max_age: Duration::from_secs(3600),
            max_count: 2,
        };
        prune_logs(dir.path(), retention, now).expect("prune");
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["gitea-task-0.log", "gitea-task-1.log"]);
    }
}
