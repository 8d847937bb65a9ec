//! Named kill points for the kill-and-restart tests (DESIGN: "precise kill points come
//! from named fail points compiled in only under a test-only cargo feature").
//!
//! With the `failpoints` feature, `hit(name)` SIGKILLs the process when the environment
//! variable `GDR_FAILPOINT` equals `name`: no destructor, no flush, exactly like a crash.
//! Without it (every product build) each call compiles to nothing and the variable's name
//! is not even in the binary.

/// The kill points, in the order a job passes them.
pub mod points {
    /// The scheduler holds a fetched task that is not yet in JetStream.
    pub const AFTER_FETCH: &str = "after-fetch";
    /// The scheduler sent an assignment's publish; JetStream's acknowledgement is
    /// outstanding (the publish may or may not have reached the server).
    pub const PUBLISH_SENT: &str = "publish-sent";
    /// A publish attempt ended without JetStream's acknowledgement and is to be retried:
    /// the assignment may be stored already.
    pub const PUBLISH_UNACKNOWLEDGED: &str = "publish-unacknowledged";
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
    #[cfg(feature = "failpoints")]
    if std::env::var_os("GDR_FAILPOINT").is_some_and(|armed| armed == name) {
        eprintln!("fail point {name}: killing the process");
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}
