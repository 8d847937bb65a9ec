//! The one table the benchmark prints, and small statistics helpers.

use std::time::Duration;

struct Row {
    figure: String,
    ours: String,
    reference: String,
    ratio: String,
    goal: String,
}

/// Rows in the order they were measured.
#[derive(Default)]
pub struct Table {
    rows: Vec<Row>,
}

impl Table {
    /// A figure with a numeric value and reference; the ratio is ours / reference.
    pub fn ratio(
        &mut self,
        figure: &str,
        (ours, ours_text): (f64, String),
        (reference, reference_text): (f64, String),
        goal: &str,
    ) {
        let ratio = if reference > 0.0 {
            format!("{:.2}×", ours / reference)
        } else {
            "–".into()
        };
        self.rows.push(Row {
            figure: figure.into(),
            ours: ours_text,
            reference: reference_text,
            ratio,
            goal: goal.into(),
        });
        eprintln!(
            "measured: {figure}: {}",
            self.rows[self.rows.len() - 1].ours
        );
    }

    /// A figure whose comparison is a difference or a bound, not a ratio.
    pub fn row(&mut self, figure: &str, ours: String, reference: String, vs: String, goal: &str) {
        eprintln!("measured: {figure}: {ours}");
        self.rows.push(Row {
            figure: figure.into(),
            ours,
            reference,
            ratio: vs,
            goal: goal.into(),
        });
    }

    /// The table as Markdown.
    pub fn markdown(&self) -> String {
        let mut out = String::from(
            "| figure | this controller | reference | ratio / difference | goal |\n\
             |---|---|---|---|---|\n",
        );
        for r in &self.rows {
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} |\n",
                r.figure, r.ours, r.reference, r.ratio, r.goal
            ));
        }
        out
    }
}

/// The `q`-quantile (0..=1) of `values` (nearest rank); zero for no values.
pub fn quantile(values: &[Duration], q: f64) -> Duration {
    if values.is_empty() {
        return Duration::ZERO;
    }
    let mut sorted = values.to_vec();
    sorted.sort();
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The mean of `values`; zero for no values.
pub fn mean(values: &[Duration]) -> Duration {
    if values.is_empty() {
        return Duration::ZERO;
    }
    values.iter().sum::<Duration>() / u32::try_from(values.len()).unwrap_or(u32::MAX)
}

/// Seconds with two decimals.
pub fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// Milliseconds with the given precision.
pub fn millis(d: Duration, decimals: usize) -> String {
    format!("{:.*} ms", decimals, d.as_secs_f64() * 1e3)
}

/// KiB as MiB with one decimal.
pub fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// A `/proc/<pid>/status` field in KiB (`VmRSS`, `VmHWM`).
pub fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}
