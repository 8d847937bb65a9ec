//! SPIFFE workload identities for the controller and the executor.
//!
//! - [`tls`]: the facade's rustls server configuration from a rotating X.509-SVID source
//!   (any peer of the trust domain; the facade checks the exact ID per request).
//! - [`svid_stream`]: the executor's SVID from exactly one Workload API stream, and its
//!   client configuration on it (exactly the facade's SPIFFE ID).
//! - [`workload_api`]: a local CA and SPIFFE Workload API endpoints (gRPC over Unix
//!   sockets, the real wire contract), the identity provider of single-host mode.

pub mod svid_stream;
pub mod tls;
pub mod workload_api;
