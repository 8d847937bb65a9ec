//! Ending what a test left behind under its own directory.
//!
//! A controller a test starts runs its process-backend executors in process groups of
//! their own, so that they outlive a controller crash (a restart adopts them). Killing the
//! controller at the end of the test therefore leaves them running, holding their
//! runner's reports for a facade that no longer exists. Every process whose working
//! directory lies under the test's directory was started for that test: this ends it, and
//! the process group it leads.

use std::path::Path;

/// SIGKILLs every process whose working directory is under `dir` (and the process group
/// each of them leads); returns how many were found. Never touches the calling process or
/// a group it does not lead.
pub fn end_processes_under(dir: &Path) -> usize {
    let Ok(dir) = dir.canonicalize() else {
        return 0;
    };
    let own = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut ended = 0;
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|p| *p != own)
        else {
            continue;
        };
        let Ok(cwd) = std::fs::read_link(entry.path().join("cwd")) else {
            continue;
        };
        if cwd.starts_with(&dir) {
            end(pid);
            ended += 1;
        }
    }
    ended
}

/// SIGKILLs `pid`, and its process group when it leads one.
fn end(pid: u32) {
    let Some(pid) = i32::try_from(pid)
        .ok()
        .filter(|p| *p > 1)
        .and_then(rustix::process::Pid::from_raw)
    else {
        return;
    };
    let leads = rustix::process::getpgid(Some(pid)).is_ok_and(|group| group == pid);
    if leads {
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    } else {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::os::unix::process::CommandExt;
    use std::time::{Duration, Instant};

    use super::*;

    /// A shell in a process group of its own that ignores SIGTERM (as an executor holding
    /// its runner's reports does) and has a child, working in `at`.
    fn stubborn(at: &Path) -> std::process::Child {
        std::process::Command::new("sh")
            .args(["-c", "trap '' TERM; sleep 60 & sleep 60; :"])
            .current_dir(at)
            .process_group(0)
            .spawn()
            .unwrap()
    }

    fn ends_within(child: &mut std::process::Child, time: Duration) -> bool {
        let deadline = Instant::now() + time;
        while Instant::now() < deadline {
            if child.try_wait().unwrap().is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    fn kill_group(child: &mut std::process::Child) {
        let _ = rustix::process::kill_process_group(
            rustix::process::Pid::from_raw(i32::try_from(child.id()).unwrap()).unwrap(),
            rustix::process::Signal::KILL,
        );
        let _ = child.wait();
    }

    /// No DESIGN invariant (the test suite, issue 37): an executor a test's controller left behind under the fixture's
    /// directory (its own process group, deaf to SIGTERM) ends when the fixture does; a
    /// process elsewhere is left alone.
    #[tokio::test]
    async fn a_process_group_left_under_a_controller_fixture_ends_with_it_and_others_stay() {
        let mock = crate::mock_gitea::MockGitea::start(crate::mock_gitea::MockConfig::default())
            .await
            .unwrap();
        let fixture = crate::controller::ControllerFixture::new(
            &mock,
            Path::new("/bin/true"),
            Path::new("/bin/true"),
        );
        let work = fixture.path().join("state/pod/executors/gitea-task-1/work");
        std::fs::create_dir_all(&work).unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let mut left = stubborn(&work);
        let mut other = stubborn(elsewhere.path());
        drop(fixture);
        let ended = ends_within(&mut left, Duration::from_secs(10));
        if !ended {
            kill_group(&mut left);
        }
        let other_runs = other.try_wait().unwrap().is_none();
        kill_group(&mut other);
        assert!(ended, "the left-over executor outlived its fixture");
        assert!(other_runs, "a process outside the fixture was ended");
    }
}
