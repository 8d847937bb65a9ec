//! Test peers that speak the real protocols.
