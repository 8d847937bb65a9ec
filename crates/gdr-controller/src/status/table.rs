//! The status as the `status` subcommand prints it: two aligned tables.

use std::fmt::Write as _;

use super::{ASSIGNMENT_COLUMNS, BACKEND_COLUMNS, StatusReport};

/// Rows under upper-case headings, each column as wide as its widest cell.
fn table<const N: usize>(out: &mut String, headings: [&str; N], rows: &[[String; N]]) {
    let headings = headings.map(str::to_uppercase);
    let mut widths = headings.clone().map(|h| h.chars().count());
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut line = |cells: &[String; N]| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i + 1 == N {
                text.push_str(cell);
            } else {
                let _ = write!(text, "{cell:<w$}  ");
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&headings);
    for row in rows {
        line(row);
    }
}

/// The report as text.
pub fn render(report: &StatusReport) -> String {
    let mut out = format!("{}\n\n", report.summary());
    if !report.leader {
        out.push_str("This replica is a standby: the leader runs every job.\n");
        return out;
    }
    let rows: Vec<_> = report.backends.iter().map(|b| b.cells()).collect();
    table(&mut out, BACKEND_COLUMNS, &rows);
    for b in &report.backends {
        for problem in &b.problems {
            let _ = writeln!(out, "  {}: {problem}", b.backend);
        }
    }
    out.push('\n');
    if report.assignments.is_empty() {
        out.push_str("No executors.\n");
    } else {
        let rows: Vec<_> = report.assignments.iter().map(|a| a.cells()).collect();
        table(&mut out, ASSIGNMENT_COLUMNS, &rows);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{AssignmentStatus, BackendStatus, Phase};

    #[test]
    fn the_table_aligns_columns_and_says_what_is_unknown() {
        let mut report = StatusReport::standby(true);
        report.leader = true;
        report.backends.push(BackendStatus {
            backend: "pod".into(),
            capacity: 3,
            in_use: 1,
            starting: 0,
            running: 1,
            finishing: 0,
            queued_jetstream: Some(12),
            unclaimed_jetstream: Some(12),
            queued_gitea: None,
            listed_seconds_ago: Some(1),
            warm: None,
            problems: vec!["the last listing of the backend failed: timeout".into()],
        });
        report.assignments.push(AssignmentStatus {
            id: "gitea-task-42".into(),
            task_id: 42,
            repository: "owner/repo".into(),
            job_key: "build".into(),
            backend: "pod".into(),
            executor: "gitea-task-42".into(),
            phase: Phase::Running,
            claimed: true,
            age_seconds: 125,
            last_event: "running; runner last heard 1s ago".into(),
        });
        let text = render(&report);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[2].starts_with("BACKEND  CAPACITY  IN USE"), "{text}");
        assert!(lines[3].starts_with("pod      3         1"), "{text}");
        assert!(lines[3].contains("12                  unknown"), "{text}");
        assert!(lines[3].ends_with("none"), "no warm pool: {text}");
        assert!(
            lines[4].contains("pod: the last listing of the backend failed"),
            "{text}"
        );
        let row = lines
            .iter()
            .find(|l| l.starts_with("gitea-task-42"))
            .expect(&text);
        assert!(
            row.contains("owner/repo") && row.contains("2m05s") && row.contains("yes"),
            "{text}"
        );
    }
}
