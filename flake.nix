{
  description = "gitea-dynamic-runner: Gitea Actions jobs in fresh Pods or Kata microVMs, each with a SPIFFE identity";

  inputs = {
    # A release crane supports: crane's lib/default.nix refuses nixpkgs older than
    # `minSupported = "26.05"`, and crane's own CI tests against nixos-26.05.
    nixpkgs.url = "github:NixOS/nixpkgs/nixos-26.05";
    # crane declares no inputs of its own, so nothing needs to follow nixpkgs.
    crane.url = "github:ipetkov/crane";
  };

  outputs =
    {
      self,
      nixpkgs,
      crane,
    }:
    let
      inherit (nixpkgs) lib;

      systems = [
        "x86_64-linux"
        "aarch64-linux"
      ];

      perSystem = lib.genAttrs systems (
        system:
        let
          pkgs = nixpkgs.legacyPackages.${system};
          rust = import ./nix/package.nix {
            inherit lib pkgs;
            craneLib = crane.mkLib pkgs;
          };
          images = {
            controller-image = import ./images/controller.nix {
              inherit lib pkgs;
              package = rust.package;
            };
            executor-image = import ./images/executor.nix {
              inherit lib pkgs;
              package = rust.package;
            };
          };
          testArgs = {
            inherit lib pkgs;
            module = self.nixosModules.default;
            package = rust.package;
            inherit (images) executor-image controller-image;
          };
          # The cluster test deploys the manifests under deploy/kubernetes/, which are written
          # separately; until they are in the tree the test is left out (with a warning) instead
          # of breaking the evaluation of every other check.
        in
        {
          packages = {
            default = rust.package;
            gitea-dynamic-runner = rust.package;
          }
          // images;

          checks =
            rust.checks
            // {
              package = rust.package;
              vm-single-host = pkgs.testers.runNixOSTest (import ./nixos-tests/single-host.nix testArgs);
              vm-cluster = pkgs.testers.runNixOSTest (
                import ./nixos-tests/cluster.nix (testArgs // { deployDir = ./deploy/kubernetes; })
              );
            };

          devShells.default = pkgs.mkShell {
            inputsFrom = [ rust.package ];
            packages = [
              pkgs.cargo-nextest
              pkgs.clippy
              pkgs.rustfmt
              pkgs.nats-server
            ];
            NATS_SERVER_BIN = "${pkgs.nats-server}/bin/nats-server";
          };
        }
      );
    in
    {
      packages = lib.mapAttrs (_: s: s.packages) perSystem;
      checks = lib.mapAttrs (_: s: s.checks) perSystem;
      devShells = lib.mapAttrs (_: s: s.devShells) perSystem;

      overlays.default = final: _prev: {
        gitea-dynamic-runner = self.packages.${final.stdenv.hostPlatform.system}.default;
      };

      # The module itself (nix/module.nix) takes the package from `pkgs` only through its
      # `package` option; this wrapper supplies the flake's build as the default.
      nixosModules.default =
        { pkgs, ... }:
        {
          imports = [ ./nix/module.nix ];
          services.gitea-dynamic-runner.package =
            lib.mkDefault
              self.packages.${pkgs.stdenv.hostPlatform.system}.default;
        };
    };
}
