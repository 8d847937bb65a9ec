//! Pure domain logic; imports no I/O crate.
