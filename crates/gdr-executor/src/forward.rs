//! The signals the executor passes on, in a module of their own: both the one-shot run (which
//! forwards them to the runner) and the job environment (which forwards them to the
//! unprivileged executor) take them, and the one-shot run also reads the job environment's
//! settings, so the type may live in neither.

/// A signal the executor passes on to its runner (the runner cancels its job on either and
/// still reports a cancelled result).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forward {
    /// SIGTERM.
    Terminate,
    /// SIGINT.
    Interrupt,
}
