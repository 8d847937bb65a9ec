//! SPIFFE workload identities for the controller and the executor.
//!
//! - [`tls`]: rustls configurations from a rotating X.509-SVID source: the facade's server
//!   side (any peer of the trust domain; the facade checks the exact ID per request) and the
//!   executor's client side (exactly the facade's SPIFFE ID).
//! - [`workload_api`]: a local CA and SPIFFE Workload API endpoints (gRPC over Unix
//!   sockets, the real wire contract), the identity provider of single-host mode.

pub mod tls;
pub mod workload_api;
