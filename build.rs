//! Compiles `proto/` with protox (a pure-Rust protoc), so building needs no
//! `protoc` binary, then generates Connect client/server code and buffa messages.

use std::path::PathBuf;

const FILES: &[&str] = &[
    "ping/v1/messages.proto",
    "ping/v1/services.proto",
    "runner/v1/messages.proto",
    "runner/v1/services.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let mut compiler = protox::Compiler::new(["proto"])?;
    compiler.include_imports(true).include_source_info(true);
    compiler.open_files(FILES)?;
    let fds_path = out.join("descriptors.bin");
    std::fs::write(
        &fds_path,
        prost::Message::encode_to_vec(&compiler.file_descriptor_set()),
    )?;
    connectrpc_build::Config::new()
        .descriptor_set(&fds_path)
        .files(FILES)
        .include_file("_connectrpc.rs")
        .compile()?;
    work_around_codegen_name_clashes(&out)?;
    Ok(())
}

/// connectrpc-codegen 0.9.0 emits two name clashes for Gitea's protocol:
/// - the proto enum `runner.v1.Result` shadows `std::result::Result`, which the
///   generated service code names unqualified;
/// - the RPC `Register` becomes `RunnerService::register`, which the blanket
///   `RunnerServiceExt::register(self: Arc<Self>, Router)` wins over in method
///   resolution inside the generated dispatch.
///
/// Both names are fixed by the wire contract, so the generated code is patched
/// instead: fully qualify `Result` and call the service method through its trait.
/// The build fails loudly if a future codegen changes shape and a patch no
/// longer applies, rather than silently producing different code.
fn work_around_codegen_name_clashes(
    out: &std::path::Path,
) -> Result<(), Box<dyn std::error::Error>> {
    let path = out.join("runner.v1.services.__connect.rs");
    let mut code = std::fs::read_to_string(&path)?;
    let patches: &[(&str, &str)] = &[
        (") -> Result<", ") -> ::core::result::Result<"),
        (
            "svc.register(ctx, sreq)",
            "RunnerService::register(&*svc, ctx, sreq)",
        ),
        (
            "svc.register(ctx, req)",
            "RunnerService::register(&*svc, ctx, req)",
        ),
    ];
    for (from, to) in patches {
        if !code.contains(from) {
            return Err(format!("codegen workaround no longer applies: {from:?} not found").into());
        }
        code = code.replace(from, to);
    }
    std::fs::write(&path, code)?;
    Ok(())
}
