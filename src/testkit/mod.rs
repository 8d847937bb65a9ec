//! Test peers that speak the real protocols.

pub mod mock_gitea;
