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
          # The module through nixpkgs' own module system over stand-ins for the NixOS options
          # it touches: no VM, no KVM. .ci/run evaluates the same file where NIXPKGS_LIB is set
          # (nix/check.sh).
          moduleEval = import ./nix/eval-module.nix { inherit lib; };
        in
        {
          packages = {
            default = rust.package;
            gitea-dynamic-runner = rust.package;

            # Not a check: it needs nested virtualisation (Kata starts a VM inside the test VM),
            # which most builders lack, and `nix flake check` must pass without it. Its
            # derivation requires the `nested` system feature besides `kvm` and `nixos-test`, so
            # a builder without it refuses the build instead of failing midway:
            #   nix build .#vm-kata   (builder: system-features = kvm nixos-test nested)
            vm-kata =
              (pkgs.testers.runNixOSTest (import ./nixos-tests/kata.nix testArgs)).overrideTestDerivation
                (prev: {
                  requiredSystemFeatures = prev.requiredSystemFeatures ++ [ "nested" ];
                });
          }
          // images;

          checks =
            rust.checks
            // {
              package = rust.package;
              module-eval = pkgs.runCommand "gitea-dynamic-runner-module-eval" {
                failed = lib.concatStringsSep "\n" moduleEval.failed;
              } ''
                if [ -n "$failed" ]; then
                  printf 'nix/eval-module.nix: expectations that do not hold:\n%s\n' "$failed" >&2
                  exit 1
                fi
                touch $out
              '';
              vm-single-host = pkgs.testers.runNixOSTest (import ./nixos-tests/single-host.nix testArgs);
              # The kustomization is the base's directory: the test copies it in as `base/`
              # beside its overlay (nixos-tests/cluster-manifests.nix).
              vm-cluster = pkgs.testers.runNixOSTest (
                import ./nixos-tests/cluster.nix (testArgs // { deployDir = ./deploy/kubernetes/base; })
              );
            };

          formatter = pkgs.nixfmt-tree;

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
      formatter = lib.mapAttrs (_: s: s.formatter) perSystem;

      # Built from the nixpkgs it is applied to (`final`), as attic's and ghaf-givc's overlays
      # do, so it follows that nixpkgs' toolchain and libraries rather than this flake's pin.
      overlays.default = final: _prev: {
        gitea-dynamic-runner =
          (import ./nix/package.nix {
            inherit (final) lib;
            pkgs = final;
            craneLib = crane.mkLib final;
          }).package;
      };

      # nix/module.nix defaults `package` to pkgs.gitea-dynamic-runner (there with
      # overlays.default); this wrapper gives the flake's own build where pkgs has none.
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
