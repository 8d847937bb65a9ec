//! The processes a runner started for its job, found through `/proc`: the official runner
//! starts each step in a process group of its own (so a signal to the runner's group
//! misses them), and on cancel kills only the step's shell, then waits for the step's
//! output to close — which a child of that shell (a `sleep`, a build tool) holds open.

use std::collections::{BTreeMap, BTreeSet};

use rustix::process::{Pid, Signal};

/// Makes this process the reaper of its orphaned descendants, so a step's process whose
/// shell the runner killed stays in this process's tree (instead of passing to init) and
/// [`kill_job_processes`] finds it.
pub fn adopt_orphans() -> std::io::Result<()> {
    rustix::process::set_child_subreaper(Some(rustix::process::getpid())).map_err(Into::into)
}

/// Kills with SIGKILL every living descendant of this process but the runner itself and
/// the trees rooted at `keep` (the job's Docker daemon, which stops its containers when it
/// is stopped), and returns how many were signalled. A daemon that escaped this process's
/// tree is not found; it ends with the Pod, the VM or the process backend's process group.
pub fn kill_job_processes(runner: Pid, keep: &[Pid]) -> usize {
    let tree = parents_from_proc();
    let kept: BTreeSet<i32> = keep
        .iter()
        .flat_map(|k| {
            let root = k.as_raw_nonzero().get();
            std::iter::once(root).chain(descendants_of(root, &tree))
        })
        .collect();
    let runner = runner.as_raw_nonzero().get();
    descendants_of(rustix::process::getpid().as_raw_nonzero().get(), &tree)
        .into_iter()
        .filter(|pid| *pid != runner && !kept.contains(pid))
        .filter_map(Pid::from_raw)
        .filter(|pid| rustix::process::kill_process(*pid, Signal::KILL).is_ok())
        .count()
}

/// Every process's parent, read from `/proc/<pid>/stat` (unreadable entries, processes
/// that just ended, are skipped).
fn parents_from_proc() -> BTreeMap<i32, i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return BTreeMap::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            Some((pid, parent_in_stat(&stat)?))
        })
        .collect()
}

/// The parent PID in a `/proc/<pid>/stat` line: the second field after the command name,
/// which is in parentheses and may itself hold spaces and parentheses.
fn parent_in_stat(stat: &str) -> Option<i32> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(1)?.parse().ok()
}

/// The descendants of `root` in a child → parent map, children before grandchildren.
fn descendants_of(root: i32, parents: &BTreeMap<i32, i32>) -> Vec<i32> {
    let mut found = Vec::new();
    let mut seen = BTreeSet::from([root]);
    let mut frontier = vec![root];
    while let Some(parent) = frontier.pop() {
        for (child, _) in parents.iter().filter(|(_, p)| **p == parent) {
            if seen.insert(*child) {
                found.push(*child);
                frontier.push(*child);
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No DESIGN invariant (cancel grace): the parent is read after the last `)`, so a
    /// command name with spaces and parentheses does not shift the fields.
    #[test]
    fn the_parent_is_read_after_a_command_name_with_spaces_and_parentheses() {
        assert_eq!(parent_in_stat("42 (a b) (c)) S 7 42 42 0"), Some(7));
        assert_eq!(parent_in_stat("42 (sleep) S 1 42 42 0"), Some(1));
        assert_eq!(parent_in_stat("garbage"), None);
    }

    /// No DESIGN invariant (cancel grace): grandchildren are found, the root and unrelated
    /// processes are not.
    #[test]
    fn descendants_are_the_whole_subtree_without_the_root() {
        let parents = BTreeMap::from([(2, 1), (3, 2), (4, 3), (5, 1), (6, 9)]);
        let mut found = descendants_of(2, &parents);
        found.sort_unstable();
        assert_eq!(found, [3, 4]);
    }

    /// No DESIGN invariant (cancel grace): an orphan — a `sleep` whose shell was killed, as
    /// the official runner kills a cancelled step's shell — is adopted by this process and
    /// killed; the "runner" and a kept tree live on.
    #[test]
    fn an_orphaned_step_process_is_killed_and_the_runner_and_kept_trees_are_not() {
        adopt_orphans().unwrap();
        let mut runner = std::process::Command::new("sleep")
            .arg("300")
            .spawn()
            .unwrap();
        let mut kept = std::process::Command::new("sleep")
            .arg("300")
            .spawn()
            .unwrap();
        // A shell that starts `sleep` in the background and is killed at once: its child
        // is orphaned.
        let mut shell = std::process::Command::new("sh")
            .args(["-c", "sleep 300 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(shell.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let orphan: i32 = line.trim().parse().unwrap();
        shell.kill().unwrap();
        shell.wait().unwrap();
        let pid = |c: &std::process::Child| Pid::from_raw(i32::try_from(c.id()).unwrap()).unwrap();
        assert!(kill_job_processes(pid(&runner), &[pid(&kept)]) >= 1);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::fs::read_to_string(format!("/proc/{orphan}/stat"))
            .is_ok_and(|s| !s.contains(") Z "))
        {
            assert!(std::time::Instant::now() < deadline, "the orphan lives on");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(
            runner.try_wait().unwrap().is_none(),
            "the runner was killed"
        );
        assert!(kept.try_wait().unwrap().is_none(), "a kept tree was killed");
        runner.kill().unwrap();
        kept.kill().unwrap();
    }
}
