//! Named kill points for the kill-and-restart tests (DESIGN: "precise kill points come
//! from named fail points compiled in only under a test-only cargo feature").
//!
//! With the `testkit` feature, `hit(name)` SIGKILLs the process when the environment
//! variable `GDR_FAILPOINT` equals `name`: no destructor, no flush, exactly like a
//! crash. Production builds (`--no-default-features`) compile every call to nothing.

/// The kill points, in the order a job passes them.
pub mod points {
    /// The scheduler holds a fetched task that is not yet in JetStream.
    pub const AFTER_FETCH: &str = "after-fetch";
    /// JetStream acknowledged the assignment.
    pub const AFTER_PUBLISH: &str = "after-publish";
    /// The worker created the executor.
    pub const AFTER_CREATE: &str = "after-create";
    /// The claim is durable on the backend; the runner has not received its task.
    pub const AFTER_CLAIM: &str = "after-claim";
    /// Gitea accepted a terminal result; the marker is not yet written.
    pub const AFTER_TERMINAL_ACCEPTED: &str = "after-terminal-accepted";
    /// The terminal marker is written; the executor is not yet deleted.
    pub const AFTER_TERMINAL_MARKER: &str = "after-terminal-marker";
}

/// Kills the process if `name` is the armed fail point.
#[inline]
pub fn hit(name: &'static str) {
    #[cfg(feature = "testkit")]
    if std::env::var_os("GDR_FAILPOINT").is_some_and(|armed| armed == name) {
        eprintln!("fail point {name}: killing the process");
        // SAFETY: kill(2) on our own pid takes plain integers and has no memory effects.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
    #[cfg(not(feature = "testkit"))]
    let _ = name;
}
