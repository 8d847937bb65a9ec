# What the crane checks' source sets hold besides crane's `commonCargoSources` (every
# Cargo.toml, Cargo.lock, *.rs and *.toml of the repository). Paths relative to the
# repository root; pure data, one entry per line.
#
# nix/package.nix builds its file sets from this, and .ci/run runs the second build and the
# test command in a view of the repository that holds exactly the same files
# (nix/source-view.sh), so a file a test reads, or a build reads, that the Nix check's
# source set lacks fails CI instead of only `nix flake check`.
{
  # The build (package, clippy, doc, fmt): the .proto files crates/gdr-proto/build.rs
  # compiles, and all of tests/ so no fixture next to the integration tests is filtered away.
  build = [
    "proto"
    "tests"
    "crates/gdr-testkit/schemas"
  ];

  # Never in a source set: fuzz/ is its own workspace (nightly only).
  exclude = [
    "fuzz"
  ];

  # What the test suite reads besides the build's files (nextest check only, so editing
  # these never rebuilds the package): flake.nix, flake.lock and nix/ (tests/nix.rs), the
  # generated and checked docs (tests/cli.rs, tests/deploy.rs), the manifests, dashboard and
  # alert rules (tests/deploy.rs, tests/operations.rs), what the cluster VM test deploys
  # (tests/deploy.rs renders it), the Kata VM test and its containerd template (tests/nix.rs)
  # and the OpenSandbox harness scripts (gdr-testkit).
  test = [
    "README.md"
    "flake.nix"
    "flake.lock"
    "nix"
    "docs"
    "deploy"
    "images"
    "nixos-tests/cluster-manifests.nix"
    "nixos-tests/kata-containerd.nix"
    "nixos-tests/kata.nix"
    "crates/gdr-testkit/opensandbox"
  ];
}
