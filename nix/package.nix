# The Rust build with crane: the product binary and the checks `nix flake check` runs.
#
# Two dependency caches, because cargo keys compiled dependencies by their feature set and
# profile:
# - `cargoArtifacts`: the product feature set (default features, `cargo build --profile
#   dist --locked`), reused by the package;
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

  # Two source sets, both crane's commonCargoSources (every Cargo.toml, Cargo.lock, *.rs and
  # *.toml: clippy.toml, rustfmt.toml, nextest's .config/nextest.toml) plus the entries of
  # ./sources.nix (pure data, also read by ./source-view.sh, which runs CI's second build and
  # test command in a view holding exactly these files):
  # - `src`, what cargo reads to build (package, clippy, doc, fmt): editing flake.nix, nix/,
  #   docs/, deploy/ or nixos-tests/ never rebuilds the Rust code;
  # - `testSrc`, `src` plus what the tests read (nextest only).
  sources = import ./sources.nix;
  under = map (relative: root + "/${relative}");
  excluded = lib.fileset.unions (map lib.fileset.maybeMissing (under sources.exclude));
  buildFiles = lib.fileset.difference (lib.fileset.unions (
    [ (craneLib.fileset.commonCargoSources root) ] ++ under sources.build
  )) excluded;
  src = lib.fileset.toSource {
    inherit root;
    fileset = buildFiles;
  };
  testSrc = lib.fileset.toSource {
    inherit root;
    fileset = lib.fileset.difference (lib.fileset.unions ([ buildFiles ] ++ under sources.test)) excluded;
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

  # The package is built with Cargo.toml's `dist` profile (whole-program LTO, one codegen
  # unit): smaller binaries, so less code mapped per executor. Its dependencies must be
  # built with the same profile to be reused.
  distProfile = {
    CARGO_PROFILE = "dist";
  };

  cargoArtifacts = craneLib.buildDepsOnly (commonArgs // distProfile);

  cargoArtifactsAll = craneLib.buildDepsOnly (
    commonArgs
    // {
      pname = "gitea-dynamic-runner-all-features";
      cargoExtraArgs = allFeatures;
    }
  );

  package = craneLib.buildPackage (
    commonArgs
    // distProfile
    // {
      inherit cargoArtifacts;
      # The product build: default features only, so no test peer (gdr-testkit) and no
      # fail point is compiled in. Two binaries: the controller's and the executor's own
      # (`gitea-dynamic-executor`, crate gdr-executor: no controller code; the executor
      # image's entrypoint, and the process backend's default next to the controller's).
      cargoExtraArgs = "--locked --package gitea-dynamic-runner --package gdr-executor";
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
  inherit package src testSrc;

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

    # The suite from `testSrc` with the `nix` profile of .config/nextest.toml, whose
    # default-filter leaves out (by name) the tests that need what nixpkgs does not give
    # the build sandbox: the real OpenSandbox server (PyPI opensandbox-server in a
    # virtualenv, no Nix derivation) and a headless Chromium (never tried in the sandbox).
    # .ci/run runs them; everything else runs here with the tools below.
    nextest = craneLib.cargoNextest (
      commonArgs
      // {
        src = testSrc;
        cargoArtifacts = cargoArtifactsAll;
        cargoExtraArgs = allFeatures;
        # The JetStream tests start a real nats-server (gdr-testkit looks at
        # NATS_SERVER_BIN, then PATH); tests/deploy.rs renders with `kubectl kustomize` and
        # evaluates the cluster test's manifests with nix-instantiate (`--store dummy://`,
        # nothing written); tests/operations.rs runs `promtool check rules`. The sandbox has
        # a loopback interface, which is all the tests use (every one binds 127.0.0.1:0).
        nativeBuildInputs = [
          pkgs.nats-server
          pkgs.kubectl
          pkgs.prometheus.cli
          pkgs.nix
        ];
        env = commonArgs.env // {
          NATS_SERVER_BIN = lib.getExe' pkgs.nats-server "nats-server";
          # The Kubernetes schemas of the fake API server (about 60 tests need them).
          KUBERNETES_SCHEMA_DIR = "${import ./kubernetes-schemas.nix { inherit pkgs; }}";
        };
        # nextest does not run doctests; `cargo test --doc` would need its own check.
        cargoNextestExtraArgs = "--profile nix --no-tests=fail";
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
