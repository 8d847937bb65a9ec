//! Compiles `proto/` (at the repository root) with protox, a pure-Rust protoc, so building
//! needs no `protoc` binary, then generates buffa messages and, with the `connect` feature,
//! the Connect client and server stubs.

use std::path::{Path, PathBuf};

const FILES: &[&str] = &[
    "ping/v1/messages.proto",
    "ping/v1/services.proto",
    "runner/v1/messages.proto",
    "runner/v1/services.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    println!("cargo:rerun-if-changed={}", proto_root.display());
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let mut compiler = protox::Compiler::new([&proto_root])?;
    compiler.include_imports(true).include_source_info(true);
    compiler.open_files(FILES)?;
    let fds_path = out.join("descriptors.bin");
    std::fs::write(
        &fds_path,
        prost::Message::encode_to_vec(&compiler.file_descriptor_set()),
    )?;
    // connectrpc-build would declare `rerun-if-changed` on `descriptors.bin`, which this
    // script writes while it runs: cargo then finds the file newer than the run and reruns
    // the script on the next invocation, which rewrites the generated code and rebuilds every
    // crate of the workspace once more (CI's test command after its clippy build). The real
    // inputs are declared instead: the proto tree above, and the one variable buffa's
    // codegen reads.
    println!("cargo:rerun-if-env-changed=BUFFA_ELEMENT_MEMORY_LIMIT");
    connectrpc_build::Config::new()
        .emit_rerun_directives(false)
        .descriptor_set(&fds_path)
        .files(FILES)
        .include_file("_connectrpc.rs")
        .compile()?;
    if std::env::var_os("CARGO_FEATURE_CONNECT").is_some() {
        work_around_register_name_clash(&out)?;
    } else {
        drop_services(&out)?;
    }
    Ok(())
}

/// Without the `connect` feature only the messages are compiled: the per-package module
/// files include the services file last, and that one line goes.
fn drop_services(out: &Path) -> Result<(), Box<dyn std::error::Error>> {
    for package in ["ping.v1", "runner.v1"] {
        let path = out.join(format!("{package}.mod.rs"));
        let code = std::fs::read_to_string(&path)?;
        let line = format!("include!(\"{package}.services.__connect.rs\");");
        if !code.contains(&line) {
            return Err(format!("{}: no {line:?} to drop", path.display()).into());
        }
        std::fs::write(&path, code.replace(&line, ""))?;
    }
    Ok(())
}

/// connectrpc-codegen 0.9.0 names the RPC `Register` `RunnerService::register`, and the
/// blanket `RunnerServiceExt::register(self: Arc<Self>, Router)` wins over it in method
/// resolution inside the generated dispatch (upstream: anthropics/connect-rust#309). The RPC
/// name is part of the URL path, so it cannot be renamed in our `.proto`; the dispatch calls
/// the service method through its trait instead. The build fails loudly if a future codegen
/// changes shape and the patch no longer applies.
fn work_around_register_name_clash(out: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let path = out.join("runner.v1.services.__connect.rs");
    let mut code = std::fs::read_to_string(&path)?;
    for (from, to) in [
        (
            "svc.register(ctx, sreq)",
            "RunnerService::register(&*svc, ctx, sreq)",
        ),
        (
            "svc.register(ctx, req)",
            "RunnerService::register(&*svc, ctx, req)",
        ),
    ] {
        if !code.contains(from) {
            return Err(format!("codegen workaround no longer applies: {from:?} not found").into());
        }
        code = code.replace(from, to);
    }
    std::fs::write(&path, code)?;
    Ok(())
}
