# Evaluates nix/module.nix with nixpkgs' real module system (lib.evalModules) over stand-ins
# for the few NixOS options and packages it touches, and reports what each scenario gives:
# the rendered unit, assertion failures, option type errors.
#
# Needs nixpkgs' `lib` (not in CI: fetch nix-community/nixpkgs.lib or use a nixpkgs checkout):
#   nix-instantiate --eval --strict --json nix/eval-module.nix --arg lib 'import /path/to/lib'
# or `NIXPKGS_LIB=/path/to/lib bash nix/check.sh`.
#
# The stand-ins are written here, not copied: NixOS' `systemd.services` (with the list
# concatenation / equal-value merge of unit settings), `users`, `networking.firewall`,
# `services.nats` (the options nix/module.nix sets), and packages as inert derivation-shaped
# attribute sets. `pkgs.formats.*.generate` writes JSON with builtins.toFile. So this checks
# option declarations, types, defaults, assertions and the unit the module builds; it cannot
# check that nixpkgs' real formats, packages or systemd accept the result.
{ lib }:
let
  fakePackage =
    {
      pname,
      version ? "1.0",
      mainProgram ? pname,
    }:
    {
      type = "derivation";
      name = "${pname}-${version}";
      inherit pname version;
      outPath = "/nix/store/00000000000000000000000000000000-${pname}-${version}";
      meta = { inherit mainProgram; };
    };

  pkgs =
    let
      format = {
        type = lib.types.attrsOf lib.types.anything;
        generate = name: value: builtins.toFile name (builtins.toJSON value);
      };
      names = [
        "bash"
        "bashInteractive"
        "coreutils"
        "curl"
        "findutils"
        "gawk"
        "gitMinimal"
        "gnugrep"
        "gnused"
        "gnutar"
        "gzip"
        "jq"
        "nodejs"
        "wget"
      ];
    in
    lib.genAttrs names (pname: fakePackage { inherit pname; })
    // {
      formats = {
        toml = _: format;
        json = _: format;
      };
      writeShellScript = name: text: builtins.toFile name text;
      runCommand = name: _env: _script: fakePackage { pname = name; };
      nats-server = fakePackage { pname = "nats-server"; };
      gitea-actions-runner = fakePackage {
        pname = "gitea-actions-runner";
        version = "3.1.0";
        mainProgram = "gitea-runner";
      };
      gitea-dynamic-runner = fakePackage { pname = "gitea-dynamic-runner"; };
      systemd = fakePackage { pname = "systemd"; };
    };

  unitOption = lib.mkOptionType {
    name = "systemd option";
    merge =
      loc: defs:
      if lib.any (d: lib.isList d.value) defs then
        lib.concatMap (d: lib.toList d.value) defs
      else
        lib.mergeEqualOption loc defs;
  };

  nixosStubs =
    { ... }:
    {
      options = {
        assertions = lib.mkOption {
          type = lib.types.listOf lib.types.attrs;
          default = [ ];
        };
        warnings = lib.mkOption {
          type = lib.types.listOf lib.types.str;
          default = [ ];
        };
        systemd.package = lib.mkOption {
          type = lib.types.package;
          default = pkgs.systemd;
        };
        systemd.services = lib.mkOption {
          default = { };
          type = lib.types.attrsOf (
            lib.types.submodule {
              freeformType = lib.types.attrsOf lib.types.anything;
              options = {
                serviceConfig = lib.mkOption {
                  type = lib.types.attrsOf unitOption;
                  default = { };
                };
                environment = lib.mkOption {
                  type = lib.types.attrsOf lib.types.str;
                  default = { };
                };
                path = lib.mkOption {
                  type = lib.types.listOf lib.types.package;
                  default = [ ];
                };
                wantedBy = lib.mkOption {
                  type = lib.types.listOf lib.types.str;
                  default = [ ];
                };
                stopIfChanged = lib.mkOption {
                  type = lib.types.bool;
                  default = true;
                };
              };
            }
          );
        };
        users.users = lib.mkOption {
          type = lib.types.attrsOf lib.types.attrs;
          default = { };
        };
        users.groups = lib.mkOption {
          type = lib.types.attrsOf lib.types.attrs;
          default = { };
        };
        networking.firewall.allowedTCPPorts = lib.mkOption {
          type = lib.types.listOf lib.types.port;
          default = [ ];
        };
        services.nats = {
          enable = lib.mkEnableOption "nats";
          jetstream = lib.mkEnableOption "jetstream";
          port = lib.mkOption {
            type = lib.types.port;
            default = 4222;
          };
          settings = lib.mkOption {
            type = lib.types.attrsOf lib.types.anything;
            default = { };
          };
        };
      };
    };

  # Without `package`: the module's default (mkPackageOption) is pkgs.gitea-dynamic-runner.
  evalWithDefaultPackage =
    config:
    lib.evalModules {
      modules = [
        nixosStubs
        ./module.nix
        {
          _module.args = { inherit pkgs; };
          services.gitea-dynamic-runner.enable = true;
        }
        config
      ];
    };

  evalWith =
    config:
    evalWithDefaultPackage {
      imports = [ config ];
      services.gitea-dynamic-runner.package = pkgs.gitea-dynamic-runner;
    };

  readScript = path: builtins.readFile (lib.head (lib.splitString " " (lib.removePrefix "+" path)));

  failedAssertions =
    eval: map (a: a.message) (lib.filter (a: !a.assertion) eval.config.assertions);

  base = {
    services.gitea-dynamic-runner = {
      registrationTokenFile = "/run/secrets/registration-token";
      capabilityKeyFile = "/run/secrets/capability-key";
      taskEncryptionPreviousKeyFiles = [
        "/run/secrets/old-0"
        "/run/secrets/old-1"
      ];
      settings = {
        gitea_instance_url = "https://git.example.com";
        trust_domain = "example.com";
        pod_capacity = 2;
      };
    };
  };

  # Forces a value, returning either { ok = value; } or { error = true; }.
  attempt =
    value:
    let
      r = builtins.tryEval (builtins.deepSeq value value);
    in
    if r.success then { ok = r.value; } else { error = true; };

  good = evalWith base;
  unit = good.config.systemd.services.gitea-dynamic-runner;

  report = {
    good = {
      assertionsFailing = failedAssertions good;
      warnings = good.config.warnings;
      inherit (unit) wantedBy stopIfChanged environment;
      serviceConfig = unit.serviceConfig;
      configFileJson =
        let
          wrapper = builtins.readFile (lib.removeSuffix " controller" unit.serviceConfig.ExecStart);
          line = lib.findFirst (lib.hasInfix "--config ") "" (lib.splitString "\n" wrapper);
        in
        builtins.readFile (lib.head (builtins.match ".*--config ([^ ]+) .*" line));
      wrapper = builtins.readFile (lib.removeSuffix " controller" unit.serviceConfig.ExecStart);
    };

    defaultPackage = attempt
      (evalWithDefaultPackage { imports = [ base ]; }).config.services.gitea-dynamic-runner.package.pname;

    registration = {
      preStart = map readScript unit.serviceConfig.ExecStartPre;
      privileged = map (lib.hasPrefix "+") unit.serviceConfig.ExecStartPre;
      inherit (unit.serviceConfig) RuntimeDirectory;
    };

    natsGood =
      let
        e = evalWith {
          imports = [ base ];
          services.gitea-dynamic-runner = {
            nats.enable = true;
            natsProducerPasswordFile = "/run/secrets/nats-producer";
            natsWorkerPasswordFile = "/run/secrets/nats-worker";
          };
          services.nats.settings.authorization = {
            timeout = 2;
            users = [
              {
                user = "admin";
                password = "admin-password";
              }
            ];
          };
        };
      in
      {
        natsStart = readScript e.config.systemd.services.nats.serviceConfig.ExecStart;
        assertionsFailing = failedAssertions e;
        natsUrl = e.config.services.gitea-dynamic-runner.settings.nats_url;
        natsEnabled = e.config.services.nats.enable && e.config.services.nats.jetstream;
        natsHost = e.config.services.nats.settings.host;
        natsServiceConfig = e.config.systemd.services.nats.serviceConfig;
        settingsAuthorization = e.config.services.nats.settings.authorization;
        controllerRequires = e.config.systemd.services.gitea-dynamic-runner.requires or [ ];
      };

    natsUserClash = failedAssertions (evalWith {
      imports = [ base ];
      services.gitea-dynamic-runner = {
        nats.enable = true;
        natsProducerPasswordFile = "/run/secrets/nats-producer";
        natsWorkerPasswordFile = "/run/secrets/nats-worker";
      };
      services.nats.settings.authorization.users = [ { user = "ci-worker"; } ];
    });

    natsWithoutPasswords = failedAssertions (evalWith {
      imports = [ base ];
      services.gitea-dynamic-runner.nats.enable = true;
    });

    storePathSecret = failedAssertions (evalWith {
      imports = [ base ];
      services.gitea-dynamic-runner.capabilityKeyFile = lib.mkForce "/nix/store/00000000000000000000000000000000-key";
    });

    secretInSettings = failedAssertions (evalWith {
      imports = [ base ];
      services.gitea-dynamic-runner.settings.nats_worker_password_file = "/run/secrets/w";
    });

    unknownKey = failedAssertions (evalWith {
      imports = [ base ];
      services.gitea-dynamic-runner.settings.pod_capacityy = 3;
    });

    bothRegistrationModes = failedAssertions (evalWith {
      imports = [ base ];
      services.gitea-dynamic-runner.runnerTokenFile = "/run/secrets/token";
    });

    missingGiteaUrl = failedAssertions (evalWith {
      services.gitea-dynamic-runner.capabilityKeyFile = "/run/secrets/capability-key";
    });

    wrongType = attempt (evalWith {
      imports = [ base ];
      services.gitea-dynamic-runner.settings.pod_capacity = lib.mkForce "four";
    }).config.services.gitea-dynamic-runner.settings.pod_capacity;

    pathLiteralSecret = attempt (evalWith {
      imports = [ base ];
      services.gitea-dynamic-runner.natsWorkerPasswordFile = ./credentials.nix;
    }).config.services.gitea-dynamic-runner.natsWorkerPasswordFile;

    staticUser =
      let
        e = evalWith {
          imports = [ base ];
          services.gitea-dynamic-runner.dynamicUser = false;
        };
        sc = e.config.systemd.services.gitea-dynamic-runner.serviceConfig;
      in
      {
        inherit (sc) DynamicUser User Group;
        user = e.config.users.users.gitea-dynamic-runner or null;
      };

    oldRunnerWarning =
      (evalWith {
        imports = [ base ];
        services.gitea-dynamic-runner.runnerPackage = fakePackage {
          pname = "gitea-actions-runner";
          version = "0.2.11";
        };
      }).config.warnings;
  };

  # What each scenario must give; `failed` lists the names of those that do not.
  expectations = {
    "a complete configuration passes every assertion" = report.good.assertionsFailing == [ ];
    "the unit signals only the controller on stop" = report.good.serviceConfig.KillMode == "process";
    "secrets reach the unit only through LoadCredential" =
      lib.elem "capability-key:/run/secrets/capability-key" report.good.serviceConfig.LoadCredential
      && !(lib.hasInfix "/run/secrets" report.good.configFileJson);
    "switch-to-configuration restarts instead of stop and start" = report.good.stopIfChanged == false;
    "a secret in the Nix store is refused" =
      lib.any (lib.hasInfix "outside the Nix store") report.storePathSecret;
    "a secret given as a setting is refused" =
      lib.any (lib.hasInfix "natsWorkerPasswordFile") report.secretInSettings;
    "an unknown setting is refused" = lib.any (lib.hasInfix "pod_capacityy") report.unknownKey;
    "registering and a ready-made token exclude each other" = report.bothRegistrationModes != [ ];
    "the Gitea URL is required" = report.missingGiteaUrl != [ ];
    "a mistyped setting is a type error" = report.wrongType ? error;
    "a Nix path literal cannot be a secret file" = report.pathLiteralSecret ? error;
    "nats.enable runs JetStream on loopback and points the controller at it" =
      report.natsGood.assertionsFailing == [ ]
      && report.natsGood.natsEnabled
      && report.natsGood.natsHost == "127.0.0.1"
      && report.natsGood.natsUrl == "nats://127.0.0.1:4222"
      && lib.elem "nats.service" report.natsGood.controllerRequires;
    "nats.enable without passwords is refused" = report.natsWithoutPasswords != [ ];
    "nats.enable keeps an admin's authorization and adds the two users to it" =
      report.natsGood.settingsAuthorization.timeout == 2
      && lib.hasInfix "(.authorization // { }).users // [ ]" report.natsGood.natsStart;
    "nats.enable checks the configuration with the two users at build time and before start" =
      lib.hasInfix "nats-gitea-dynamic-runner-checked" report.natsGood.natsStart
      && lib.hasInfix "nats.json -t" report.natsGood.natsStart;
    "a NATS user of the admin named like the controller's is refused" =
      lib.any (lib.hasInfix "must not define them too") report.natsUserClash;
    "the package defaults to pkgs.gitea-dynamic-runner" = (report.defaultPackage.ok or null) == "gitea-dynamic-runner";
    "the first start registers: no register command, the token handed over only while unregistered" =
      report.registration.privileged == [ true ]
      && lib.hasInfix "registration-token" (lib.head report.registration.preStart)
      && lib.hasInfix "exit 0" (lib.head report.registration.preStart)
      && !(lib.hasInfix " register" report.good.wrapper)
      && lib.hasInfix "gitea_runner_registration_token_file=/run/gitea-dynamic-runner/registration-token" report.good.wrapper
      && report.registration.RuntimeDirectory == "gitea-dynamic-runner";
    "the registration token is no LoadCredential (gone once registered)" =
      !(lib.any (lib.hasInfix "registration") report.good.serviceConfig.LoadCredential);
    "a static user is created and used" =
      report.staticUser.DynamicUser == false && report.staticUser.User == "gitea-dynamic-runner" && report.staticUser.user != null;
    "an old runner with `cancelling` warns" = report.oldRunnerWarning != [ ];
  };
in
report
// {
  failed = lib.attrNames (lib.filterAttrs (_: ok: !ok) expectations);
}
