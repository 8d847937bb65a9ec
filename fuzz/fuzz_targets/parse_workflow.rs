//! Workflow payloads come from Gitea but are written by users; parsing must never crash.
//! Run with `cargo fuzz run parse_workflow` from the repository root.
#![no_main]

use gdr_core::workflow::parse_single_job;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = parse_single_job(data);
});
