# The Rust build with crane: the product binary and the checks `nix flake check` runs.
#
# Two dependency caches, because cargo keys compiled dependencies by their feature set:
# - `cargoArtifacts`: the product feature set (default features, `cargo build --release
#   --locked`), reused by the package;
# - `cargoArtifactsAll`: `--workspace --all-features` (test peers, fail points), reused by
#   clippy, nextest and doc, which must see exactly what CI sees.
{
  lib,
  pkgs,
  craneLib,
}:
let
  root = ../.;
  cargoToml = lib.importTOML ../Cargo.toml;

  # Everything cargo reads: manifests, the lock file, every `.rs` (including each crate's
  # `build.rs`), `.toml` configuration (clippy.toml, rustfmt.toml), nextest's
  # `.config/nextest.toml` (test threads, priorities, timeouts: the same as in CI), the
  # `.proto` files `crates/gdr-proto/build.rs` compiles from the top-level `proto/`, and all
  # of `tests/` so that fixtures next to the integration tests are never filtered away.
  # `fuzz/` is its own workspace (nightly only) and stays out; so do flake.nix, nix/,
  # images/ and nixos-tests/, so editing them never rebuilds the Rust code.
  src = lib.fileset.toSource {
    inherit root;
    fileset = lib.fileset.difference (lib.fileset.unions [
      (craneLib.fileset.commonCargoSources root)
      (lib.fileset.maybeMissing ../.config/nextest.toml)
      ../proto
      ../tests
    ]) (lib.fileset.maybeMissing ../fuzz);
  };

  commonArgs = {
    inherit src;
    pname = "gitea-dynamic-runner";
    # The root package inherits its version from [workspace.package].
    inherit (cargoToml.workspace.package) version;
    strictDeps = true;
    # No protoc: protos are compiled with protox (pure Rust) in build.rs.
    # aws-lc-sys builds its C sources with the stdenv compiler; never pick up a system
    # AWS-LC by accident, so every build uses the vendored, locked sources.
    env.AWS_LC_SYS_USE_SYSTEM = "0";
  };

  # The same flags as `.ci/run` and the README's test command.
  allFeatures = "--locked --workspace --all-features";

  cargoArtifacts = craneLib.buildDepsOnly commonArgs;

  cargoArtifactsAll = craneLib.buildDepsOnly (
    commonArgs
    // {
      pname = "gitea-dynamic-runner-all-features";
      cargoExtraArgs = allFeatures;
    }
  );

  package = craneLib.buildPackage (
    commonArgs
    // {
      inherit cargoArtifacts;
      # The product build: default features only, so no test peer (gdr-testkit) and no
      # fail point is compiled in.
      cargoExtraArgs = "--locked";
      # Tests run once, in the nextest check, with the test features.
      doCheck = false;
      meta = {
        description = cargoToml.package.description;
        license = lib.licenses.asl20;
        mainProgram = "gitea-dynamic-runner";
        platforms = lib.platforms.linux;
      };
    }
  );
in
{
  inherit package src;

  checks = {
    clippy = craneLib.cargoClippy (
      commonArgs
      // {
        cargoArtifacts = cargoArtifactsAll;
        cargoExtraArgs = allFeatures;
        cargoClippyExtraArgs = "--all-targets -- --deny warnings";
      }
    );

    fmt = craneLib.cargoFmt {
      inherit src;
      inherit (commonArgs) pname version;
    };

    nextest = craneLib.cargoNextest (
      commonArgs
      // {
        cargoArtifacts = cargoArtifactsAll;
        cargoExtraArgs = allFeatures;
        # The JetStream tests start a real nats-server (gdr-testkit looks at
        # NATS_SERVER_BIN, then PATH). The sandbox has a loopback interface, which is all
        # the tests use (every one binds 127.0.0.1:0).
        nativeBuildInputs = [ pkgs.nats-server ];
        env = commonArgs.env // {
          NATS_SERVER_BIN = lib.getExe' pkgs.nats-server "nats-server";
        };
        # nextest does not run doctests; `cargo test --doc` would need its own check.
        cargoNextestExtraArgs = "--no-tests=fail";
      }
    );

    doc = craneLib.cargoDoc (
      commonArgs
      // {
        cargoArtifacts = cargoArtifactsAll;
        cargoExtraArgs = allFeatures;
        cargoDocExtraArgs = "--no-deps";
        env = commonArgs.env // {
          RUSTDOCFLAGS = "--deny warnings";
        };
      }
    );
  };
}
