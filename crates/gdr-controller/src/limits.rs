//! The process's open-file limit (DESIGN invariant 21).
//!
//! Every facade connection, executor, NATS and Gitea connection is a file descriptor. The
//! soft limit most systems start processes with (1024) is exhausted by a few hundred idle
//! connections; the hard limit is usually far higher and ours to take.

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// The open-file limit before and after [`raise_open_files`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFiles {
    /// Soft limit at start (`None`: unlimited).
    pub before: Option<u64>,
    /// Soft limit now.
    pub now: Option<u64>,
    /// Hard limit.
    pub hard: Option<u64>,
}

impl OpenFiles {
    /// The soft limit now, `u64::MAX` when unlimited.
    pub fn soft(&self) -> u64 {
        self.now.unwrap_or(u64::MAX)
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit. On failure the limit stays as it was
/// (and is reported as such).
pub fn raise_open_files() -> Result<OpenFiles, rustix::io::Errno> {
    let Rlimit { current, maximum } = getrlimit(Resource::Nofile);
    if current == maximum {
        return Ok(OpenFiles {
            before: current,
            now: current,
            hard: maximum,
        });
    }
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: maximum,
            maximum,
        },
    )?;
    Ok(OpenFiles {
        before: current,
        now: getrlimit(Resource::Nofile).current,
        hard: maximum,
    })
}
