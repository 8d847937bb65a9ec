//! The one stop signal of the controller, shared with every other crate (`gdr-shutdown`):
//! every component and server takes a [`Shutdown`] and stops when it is triggered. `main`
//! owns the trigger (signals), the runtime derives the component-level ones (stop fetching
//! first, then the rest).

pub use gdr_shutdown::{Shutdown, ShutdownGuard, ShutdownTrigger, shutdown_channel};
