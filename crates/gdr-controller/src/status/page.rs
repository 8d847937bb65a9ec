//! The status page at `/`: plain HTML, no script, no external asset; it reloads itself.

use std::fmt::Write as _;

use super::{ASSIGNMENT_COLUMNS, BACKEND_COLUMNS, StatusReport};

/// How often the page reloads itself, in seconds.
pub const REFRESH_SECONDS: u32 = 5;

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:1.5rem;color:#222}\
h1{font-size:1.3rem}h2{font-size:1.1rem;margin-top:1.5rem}\
table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:.25rem .6rem;text-align:left}\
th{background:#f3f3f3}td.n{text-align:right}\
tr[data-phase=running] td{background:#eef7ee}tr[data-phase=ended] td{background:#fbeaea}\
.problem{color:#a00}.muted{color:#777}";

/// Escapes text for HTML element content and double-quoted attributes.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn head<const N: usize>(out: &mut String, columns: [&str; N]) {
    out.push_str("<thead><tr>");
    for c in columns {
        let _ = write!(out, "<th>{}</th>", escape(c));
    }
    out.push_str("</tr></thead>");
}

fn cells<const N: usize>(out: &mut String, cells: &[String; N], numeric: &[usize]) {
    for (i, cell) in cells.iter().enumerate() {
        let class = if numeric.contains(&i) {
            " class=\"n\""
        } else {
            ""
        };
        let _ = write!(out, "<td{class}>{}</td>", escape(cell));
    }
}

/// The report as an HTML document.
pub fn render(report: &StatusReport) -> String {
    let mut out = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"refresh\" content=\"{REFRESH_SECONDS}\">\
         <meta name=\"viewport\" content=\"width=device-width\">\
         <title>gitea-dynamic-runner status</title><style>{STYLE}</style></head><body>\
         <h1>gitea-dynamic-runner</h1><p id=\"summary\">{}</p>",
        escape(&report.summary())
    );
    if !report.leader {
        out.push_str("<p id=\"standby\">This replica is a standby: the leader runs every job.</p>");
    } else {
        out.push_str("<h2>Backends</h2><table id=\"backends\">");
        head(&mut out, BACKEND_COLUMNS);
        out.push_str("<tbody>");
        for b in &report.backends {
            let _ = write!(out, "<tr data-backend=\"{}\">", escape(&b.backend));
            cells(&mut out, &b.cells(), &[1, 2, 3, 4, 5, 6, 7]);
            out.push_str("</tr>");
        }
        out.push_str("</tbody></table>");
        for b in &report.backends {
            for problem in &b.problems {
                let _ = write!(
                    out,
                    "<p class=\"problem\">{}: {}</p>",
                    escape(&b.backend),
                    escape(problem)
                );
            }
        }
        out.push_str("<h2>Assignments</h2><table id=\"assignments\">");
        head(&mut out, ASSIGNMENT_COLUMNS);
        out.push_str("<tbody>");
        for a in &report.assignments {
            let _ = write!(
                out,
                "<tr data-assignment-id=\"{}\" data-phase=\"{}\">",
                escape(&a.id),
                a.phase.as_str()
            );
            cells(&mut out, &a.cells(), &[6]);
            out.push_str("</tr>");
        }
        if report.assignments.is_empty() {
            let _ = write!(
                out,
                "<tr><td class=\"muted\" colspan=\"{}\">no executors</td></tr>",
                ASSIGNMENT_COLUMNS.len()
            );
        }
        out.push_str("</tbody></table>");
    }
    let _ = writeln!(
        out,
        "<p class=\"muted\">Reloads every {REFRESH_SECONDS} s. JSON: <a href=\"/status\">/status</a>, \
         metrics: <a href=\"/metrics\">/metrics</a>.</p></body></html>"
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{AssignmentStatus, Phase};

    #[test]
    fn text_from_jobs_is_escaped_and_the_page_has_no_script_or_external_asset() {
        let mut report = StatusReport::standby(true);
        report.leader = true;
        report.assignments.push(AssignmentStatus {
            id: "gitea-task-1".into(),
            task_id: 1,
            repository: "o/<script>alert(1)</script>".into(),
            job_key: "build".into(),
            backend: "pod".into(),
            executor: "x".into(),
            phase: Phase::Starting,
            claimed: false,
            age_seconds: 1,
            last_event: "starting: \"ImagePullBackOff\" & more".into(),
        });
        let html = render(&report);
        assert!(!html.contains("<script"), "{html}");
        assert!(
            html.contains("o/&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{html}"
        );
        assert!(
            html.contains("&quot;ImagePullBackOff&quot; &amp; more"),
            "{html}"
        );
        assert!(html.contains("<meta http-equiv=\"refresh\" content=\"5\">"));
        assert!(!html.contains("http://") && !html.contains("https://") && !html.contains("src="));
    }
}
