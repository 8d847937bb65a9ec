# services.gitea-dynamic-runner: the controller as a hardened systemd service.
#
# Written against nixpkgs' own modules (read; evaluated with nixpkgs' lib over stand-ins by
# nix/eval-module.nix, never against a full nixpkgs here):
# nixos/modules/services/continuous-integration/{act-runner/generic.nix,forgejo-runner.nix}
# (runner packages, host packages on PATH, LoadCredential),
# nixos/modules/services/networking/nats.nix (services.nats options, its unit and its
# build-time `nats-server -t` validation), nixos/modules/services/cluster/rancher/{default,k3s}.nix
# (KillMode = "process" for a daemon whose children must outlive it) and
# nixos/lib/systemd-unit-options.nix (stopIfChanged).
#
# Secrets: every secret key of the binary (nix/credentials.nix) has a `*File` option here.
# The file is handed to the unit with LoadCredential (read by systemd as root, exposed only
# to this unit under $CREDENTIALS_DIRECTORY) and the binary is pointed at it with
# `--set <key>=$CREDENTIALS_DIRECTORY/<credential>` (the wrapper script expands it); nothing
# secret is ever written to the Nix store. The one exception is the registration token,
# needed only until the first start has registered (below).
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib)
    literalExpression
    mkDefault
    mkEnableOption
    mkIf
    mkMerge
    mkOption
    mkPackageOption
    types
    ;

  cfg = config.services.gitea-dynamic-runner;

  unitName = "gitea-dynamic-runner";
  stateDir = "/var/lib/${unitName}";

  table = import ./credentials.nix;
  settingsOptions = import ./settings-options.nix { inherit lib; };
  knownKeys = builtins.attrNames settingsOptions;
  secretKeys = map (s: s.key) table.secrets;

  settingsFormat = pkgs.formats.toml { };

  # The controller's own runner credential comes either from its first start (the one-command
  # start: with a registration token the controller registers itself and writes the runner's
  # UUID and token into the state directory, mode 0600) or ready-made from a credential file.
  # The registration token is not a LoadCredential, which systemd would load at every start
  # (and fail without once the file is gone): a privileged ExecStartPre copies it into the
  # runtime directory only while the runner is not registered; the runtime directory goes
  # when the unit stops, and once registered nothing reads the token file again (it may be
  # deleted). The UUID is not secret, so it stays an ordinary setting.
  registers = cfg.registrationTokenFile != null;
  registrationKey = "gitea_runner_registration_token_file";
  runtimeDir = "/run/${unitName}";
  registrationCopy = "${runtimeDir}/registration-token";
  runnerTokenPath = "${stateDir}/runner-token";
  runnerUuidPath = "${stateDir}/runner-uuid";
  effectiveUuidPath =
    if cfg.settings.gitea_runner_uuid_file != null then cfg.settings.gitea_runner_uuid_file else runnerUuidPath;
  credentialSecrets = lib.filter (s: s.key != registrationKey) table.secrets;

  # Each configured secret as { name = <credential>; path = <file>; }.
  credentialsOf =
    s:
    let
      value = cfg.${s.option};
    in
    if s.list then
      lib.imap0 (i: path: {
        name = "${s.credential}-${toString i}";
        inherit path;
      }) value
    else
      lib.optional (value != null) {
        name = s.credential;
        path = value;
      };

  loaded = lib.concatMap credentialsOf credentialSecrets;
  secretPaths = map (c: c.path) loaded ++ lib.optional registers cfg.registrationTokenFile;

  # `key=<file>` for every configured secret, passed as `--set` so the binary reads each
  # secret from $CREDENTIALS_DIRECTORY (list keys take their files comma-separated).
  secretSets =
    lib.concatMap (
      s:
      let
        creds = credentialsOf s;
      in
      lib.optional (creds != [ ]) "${s.key}=${
        lib.concatMapStringsSep "," (c: "$CREDENTIALS_DIRECTORY/${c.name}") creds
      }"
    ) credentialSecrets
    ++ lib.optional registers "gitea_runner_token_file=${runnerTokenPath}";

  # Only keys that are set reach the file: an unset key keeps the binary's own default.
  rendered = lib.filterAttrs (_: v: v != null) cfg.settings;
  configFile = settingsFormat.generate "gitea-dynamic-runner.toml" rendered;

  exe = lib.getExe cfg.package;
  natsServer = lib.getExe' pkgs.nats-server "nats-server";
  effectiveNatsServer =
    if cfg.settings.nats_server_binary != null then cfg.settings.nats_server_binary else natsServer;

  # The controller with its configuration and credentials; the registration token only while
  # ExecStartPre has put it there (not registered yet).
  wrapper = pkgs.writeShellScript "gitea-dynamic-runner-unit" ''
    set -eu
    command=$1
    shift
    set -- --config ${configFile} ${
      lib.concatMapStringsSep " " (set: ''--set "${set}"'') secretSets
    } "$@"
    if [ -e ${registrationCopy} ]; then
      set -- --set "${registrationKey}=${registrationCopy}" "$@"
    fi
    exec ${exe} "$command" "$@"
  '';

  # Runs as root ("+"): hands the registration token to the first start, never to a later one.
  handOverRegistrationToken = pkgs.writeShellScript "gitea-dynamic-runner-registration-token" ''
    set -eu
    if [ -s ${lib.escapeShellArg effectiveUuidPath} ] && [ -s ${runnerTokenPath} ]; then
      exit 0
    fi
    owner=$(${lib.getExe' pkgs.coreutils "stat"} -c %u:%g ${runtimeDir})
    ${lib.getExe' pkgs.coreutils "install"} -m 0400 -o "''${owner%:*}" -g "''${owner#*:}" \
      ${lib.escapeShellArg cfg.registrationTokenFile} ${registrationCopy}
  '';

  # KillMode = "process": on any stop systemd signals only the controller, so executors
  # (their own process groups, DESIGN invariant 19) survive a restart and are re-adopted.
  # This runs after the controller is gone and decides what else goes:
  # - a `restart` job (systemctl restart; switch-to-configuration with stopIfChanged = false)
  #   or a failure that Restart=on-failure will retry: executors stay;
  # - a `stop` job, or a clean exit nothing will restart: every remaining process of the unit
  #   gets SIGTERM, then SIGKILL after executorStopTimeout.
  # A leftover embedded nats-server (the controller died without reaping it) is always
  # stopped: the next controller starts its own on the same store.
  stopPost = pkgs.writeShellScript "gitea-dynamic-runner-stop-post" ''
    set -u
    unit=${unitName}.service
    PATH=${
      lib.makeBinPath [
        config.systemd.package
        pkgs.coreutils
        pkgs.gawk
      ]
    }
    job=$(systemctl list-jobs --no-legend "$unit" 2>/dev/null | awk -v u="$unit" '$2 == u { print $3 }')
    case "$job" in
      restart | try-restart | reload-or-restart) stop_all=0 ;;
      stop) stop_all=1 ;;
      *) if [ "''${SERVICE_RESULT:-success}" = success ]; then stop_all=1; else stop_all=0; fi ;;
    esac
    nats=$(readlink -f ${lib.escapeShellArg (toString effectiveNatsServer)} 2>/dev/null || true)
    cgroup=
    while IFS= read -r line; do
      case "$line" in 0::*) cgroup=''${line#0::} ;; esac
    done < /proc/self/cgroup
    [ -n "$cgroup" ] || exit 0
    # Read with builtins only: a forked reader would itself be in the list.
    mapfile -t pids < "/sys/fs/cgroup$cgroup/cgroup.procs" || exit 0
    targets=()
    for pid in "''${pids[@]}"; do
      [ "$pid" = "$$" ] && continue
      if [ "$stop_all" = 1 ]; then
        targets+=("$pid")
      elif [ -n "$nats" ] && [ "$(readlink -f "/proc/$pid/exe" 2>/dev/null)" = "$nats" ]; then
        targets+=("$pid")
      fi
    done
    [ "''${#targets[@]}" -eq 0 ] && exit 0
    echo "stopping ''${#targets[@]} remaining process(es) of $unit (job: ''${job:-none})"
    kill -TERM "''${targets[@]}" 2>/dev/null
    deadline=$((SECONDS + ${toString cfg.executorStopTimeout}))
    while [ "$SECONDS" -lt "$deadline" ]; do
      alive=0
      for pid in "''${targets[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      [ "$alive" = 0 ] && exit 0
      sleep 0.5
    done
    echo "SIGKILL to what is left after ${toString cfg.executorStopTimeout}s"
    kill -KILL "''${targets[@]}" 2>/dev/null
    exit 0
  '';

  # Port of a listen address like "0.0.0.0:8443" or "[::]:8443".
  portOf =
    listen: fallback:
    if listen == null then fallback else lib.toInt (lib.last (lib.splitString ":" listen));

  storeDir = builtins.storeDir;
  isSafeSecretPath = p: lib.hasPrefix "/" p && !(lib.hasPrefix "${storeDir}/" p || p == storeDir);

  secretOption =
    s:
    let
      key = lib.toUpper s.key;
    in
    if s.list then
      mkOption {
        type = types.listOf types.str;
        default = [ ];
        example = [ "/run/secrets/gitea-dynamic-runner/task-key-2025" ];
        description = ''
          Files for `${s.key}` (${key}), delivered with `LoadCredential` as
          `${s.credential}-0`, `${s.credential}-1`, …. Absolute paths outside the Nix store,
          given as strings (a Nix path literal would copy the secret into the store).
        '';
      }
    else if s.key == registrationKey then
      mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "/run/secrets/gitea-dynamic-runner/${s.credential}";
        description = ''
          File holding a runner registration token from Gitea (`${s.key}`, ${key}): the
          one-command start. While the runner's UUID and token files do not exist, the unit
          hands the token to the controller, which registers itself and writes both into
          ${stateDir} (mode 0600); later starts never read the token file again, so it may be
          removed. An absolute path outside the Nix store, given as a string. Alternative:
          `runnerTokenFile` plus `settings.gitea_runner_uuid_file` (an existing registration).
        '';
      }
    else
      mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "/run/secrets/gitea-dynamic-runner/${s.credential}";
        description = ''
          File for `${s.key}` (${key}), delivered with `LoadCredential` as `${s.credential}`.
          An absolute path outside the Nix store, given as a string (a Nix path literal would
          copy the secret into the store).
        '';
      };

  natsUsers = {
    producer = if cfg.settings.nats_producer_user != null then cfg.settings.nats_producer_user else "ci-producer";
    worker = if cfg.settings.nats_worker_user != null then cfg.settings.nats_worker_user else "ci-worker";
  };

  # NATS' configuration cannot read a password from a file, and services.nats' JSON settings
  # cannot reference a variable, so the unit's ExecStart is replaced: it adds the two users,
  # with the passwords from their credentials, to services.nats' own settings (keeping every
  # user and key of an admin's `authorization`), checks the result with `nats-server -t` and
  # runs it. What services.nats validates at build time (`validateConfig`) is validated here
  # too, on the same settings with the two users and placeholder passwords.
  natsBaseConfig = (pkgs.formats.json { }).generate "nats-base.json" config.services.nats.settings;
  natsRuntimeDir = "/run/gitea-dynamic-runner-nats";
  addNatsUsers = ''
    def trim: sub("^\\s+"; "") | sub("\\s+$"; "");
    .authorization = ((.authorization // { }) + { users: (((.authorization // { }).users // [ ]) + [
      { user: $producer_user, password: ($producer | trim) },
      { user: $worker_user, password: ($worker | trim) } ]) })
  '';
  jqUsers = producer: worker: ''
    ${lib.getExe pkgs.jq} \
      --rawfile producer ${producer} \
      --rawfile worker ${worker} \
      --arg producer_user ${lib.escapeShellArg natsUsers.producer} \
      --arg worker_user ${lib.escapeShellArg natsUsers.worker} \
      ${lib.escapeShellArg addNatsUsers} \
      ${natsBaseConfig}'';
  natsConfigChecked =
    if config.services.nats.validateConfig or true then
      pkgs.runCommand "nats-gitea-dynamic-runner-checked"
        {
          nativeBuildInputs = [ pkgs.nats-server ];
        }
        ''
          echo placeholder-producer > producer
          echo placeholder-worker > worker
          ${jqUsers "producer" "worker"} > nats.json
          nats-server --config nats.json -t
          ln -s ${natsBaseConfig} $out
        ''
    else
      natsBaseConfig;
  natsStart = pkgs.writeShellScript "nats-with-gitea-dynamic-runner-users" ''
    set -eu
    umask 077
    # Built only where the settings with the two users pass `nats-server -t`: ${natsConfigChecked}
    ${jqUsers ''"$CREDENTIALS_DIRECTORY/producer-password"'' ''"$CREDENTIALS_DIRECTORY/worker-password"''} > ${natsRuntimeDir}/nats.json
    ${natsServer} --config ${natsRuntimeDir}/nats.json -t
    exec ${natsServer} --config ${natsRuntimeDir}/nats.json
  '';
  adminNatsUsers = map (u: u.user or null) (
    (config.services.nats.settings.authorization or { }).users or [ ]
  );
in
{
  options.services.gitea-dynamic-runner = {
    enable = mkEnableOption "gitea-dynamic-runner, the controller that runs each Gitea Actions job in a fresh Pod or microVM";

    package = mkPackageOption pkgs "gitea-dynamic-runner" {
      extraDescription = ''
        The flake's `overlays.default` adds it to pkgs; its `nixosModules.default` sets the
        flake's own build instead where pkgs has none.
      '';
    };

    runnerPackage = mkPackageOption pkgs "gitea-actions-runner" {
      extraDescription = ''
        The official, unmodified Gitea runner that each process-backend executor runs as
        `daemon --once`. Its main program becomes `settings.runner_binary` unless that is set.
      '';
    };

    hostPackages = mkOption {
      type = types.listOf types.package;
      default = with pkgs; [
        bash
        coreutils
        curl
        findutils
        gawk
        gitMinimal
        gnugrep
        gnused
        gnutar
        gzip
        nodejs
        wget
      ];
      defaultText = literalExpression "with pkgs; [ bash coreutils curl findutils gawk gitMinimal gnugrep gnused gnutar gzip nodejs wget ]";
      description = ''
        Packages on the PATH of the controller, which the process backend passes on to
        executors and so to jobs (the official runner in host mode). JavaScript actions such
        as actions/checkout need `nodejs` and `git`.
      '';
    };

    settings = mkOption {
      default = { };
      description = ''
        Configuration of the binary, rendered to TOML (`--config`). Every key of
        `gitea-dynamic-runner check-config --reference` has a typed option; `null` (the
        default) leaves the binary's own default in force. Secret keys are set through the
        `*File` options of this module instead.
      '';
      example = literalExpression ''
        {
          gitea_instance_url = "https://git.example.com";
          trust_domain = "example.com";
          pod_backend = "process";
          vm_backend = "process";
        }
      '';
      type = types.submodule {
        freeformType = settingsFormat.type;
        options = settingsOptions;
      };
    };

    nats = {
      enable = mkOption {
        type = types.bool;
        default = false;
        description = ''
          Run NATS with JetStream through `services.nats` on this host (listening on
          127.0.0.1 only unless `services.nats.settings.host` says otherwise) instead of the
          controller's embedded nats-server. Sets `settings.nats_url` and adds the producer
          and worker users with the passwords of `natsProducerPasswordFile` and
          `natsWorkerPasswordFile` (both required).
        '';
      };
      port = mkOption {
        type = types.port;
        default = 4222;
        description = "Port of the services.nats server.";
      };
    };

    dynamicUser = mkOption {
      type = types.bool;
      default = true;
      description = ''
        Run under a systemd DynamicUser. Set to false to run as `user`/`group`, e.g. when
        other services must own files the controller reads.
      '';
    };

    user = mkOption {
      type = types.str;
      default = "gitea-dynamic-runner";
      description = "User of the service when dynamicUser is false (created if it is the default name).";
    };

    group = mkOption {
      type = types.str;
      default = "gitea-dynamic-runner";
      description = "Group of the service when dynamicUser is false (created if it is the default name).";
    };

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = "Open the facade port (runner_facade_listen) and the health port (health_listen).";
    };

    executorStopTimeout = mkOption {
      type = types.ints.positive;
      default = 30;
      description = ''
        Seconds between SIGTERM and SIGKILL for executors and jobs left when the service is
        stopped (not restarted: a restart keeps running executors, see the unit's KillMode).
      '';
    };
  }
  // lib.listToAttrs (map (s: lib.nameValuePair s.option (secretOption s)) table.secrets);

  config = mkIf cfg.enable (mkMerge [
    {
      assertions =
        let
          allSecretPaths = secretPaths;
          unknown = lib.subtractLists knownKeys (builtins.attrNames rendered);
          secretsInSettings = lib.filter (k: (cfg.settings.${k} or null) != null) secretKeys;
        in
        [
          {
            assertion = cfg.settings.gitea_instance_url != null;
            message = "services.gitea-dynamic-runner.settings.gitea_instance_url must be set.";
          }
          {
            assertion = lib.all isSafeSecretPath allSecretPaths;
            message = "services.gitea-dynamic-runner: secret files must be absolute paths outside the Nix store (the store is world-readable); offending: ${
              lib.concatStringsSep ", " (lib.filter (p: !isSafeSecretPath p) allSecretPaths)
            }";
          }
          {
            assertion = secretsInSettings == [ ];
            message = "services.gitea-dynamic-runner.settings: ${lib.concatStringsSep ", " secretsInSettings} are secrets; set them with the module's *File options (${
              lib.concatMapStringsSep ", " (s: s.option) (lib.filter (s: lib.elem s.key secretsInSettings) table.secrets)
            }), which deliver them with LoadCredential.";
          }
          {
            # The binary refuses unknown keys (serde deny_unknown_fields); fail at build time.
            assertion = unknown == [ ];
            message = "services.gitea-dynamic-runner.settings: unknown key(s) ${lib.concatStringsSep ", " unknown}; see `gitea-dynamic-runner check-config --reference`.";
          }
          {
            assertion = !(registers && cfg.runnerTokenFile != null);
            message = "services.gitea-dynamic-runner: set either registrationTokenFile (register once) or runnerTokenFile (an existing registration), not both.";
          }
          {
            assertion = cfg.settings.state_dir == stateDir;
            message = "services.gitea-dynamic-runner.settings.state_dir must stay ${stateDir} (the unit's StateDirectory).";
          }
        ];

      warnings =
        lib.optional
          (
            lib.versionOlder (cfg.runnerPackage.version or "0") "2.0"
            && lib.elem "cancelling" (
              if cfg.settings.runner_capabilities != null then cfg.settings.runner_capabilities else [ "cancelling" ]
            )
          )
          "services.gitea-dynamic-runner: runner_capabilities includes `cancelling`, which needs the official runner >= 2.0, but runnerPackage is ${cfg.runnerPackage.version or "unversioned"}.";

      services.gitea-dynamic-runner.settings = {
        state_dir = mkDefault stateDir;
        runner_binary = mkDefault (lib.getExe cfg.runnerPackage);
        nats_server_binary = mkDefault natsServer;
        gitea_runner_uuid_file = mkIf registers (mkDefault runnerUuidPath);
      };

      systemd.services.${unitName} = {
        description = "gitea-dynamic-runner controller";
        documentation = [ "https://github.com/gitea-dynamic-runner/gitea-dynamic-runner" ];
        wantedBy = [ "multi-user.target" ];
        wants = [ "network-online.target" ];
        after = [ "network-online.target" ] ++ lib.optional cfg.nats.enable "nats.service";
        requires = lib.optional cfg.nats.enable "nats.service";
        path = cfg.hostPackages;
        environment.HOME = stateDir;

        # switch-to-configuration then runs `systemctl restart` instead of stop + start, which
        # keeps executors running across an upgrade (see stopPost).
        stopIfChanged = false;

        serviceConfig = {
          Type = "exec";
          ExecStartPre = lib.optional registers "+${handOverRegistrationToken}";
          ExecStart = "${wrapper} controller";
          ExecStopPost = "+${stopPost}";
          Restart = "on-failure";
          RestartSec = "5s";
          # SIGTERM is how systemd stops it; the controller's graceful exit must not count as a
          # failure (stopPost tells a stop from a crash by the result).
          SuccessExitStatus = [ 143 ];
          TimeoutStopSec = "${toString (cfg.executorStopTimeout + 60)}s";

          # Executors are process groups of their own and must outlive a controller restart
          # (invariant 19); "process" signals only the controller, stopPost does the rest.
          KillMode = "process";

          LoadCredential = map (c: "${c.name}:${c.path}") loaded;

          DynamicUser = cfg.dynamicUser;
          User = mkIf (!cfg.dynamicUser) cfg.user;
          Group = mkIf (!cfg.dynamicUser) cfg.group;
          StateDirectory = unitName;
          StateDirectoryMode = "0700";
          # Holds the registration token for the first start only; removed when it stops.
          RuntimeDirectory = unitName;
          RuntimeDirectoryMode = "0700";
          WorkingDirectory = stateDir;
          UMask = "0077";
          # The embedded nats-server needs two descriptors per JetStream stream, jobs many more.
          LimitNOFILE = 65536;

          # Hardening. What stays enabled here binds the jobs too (the process backend runs
          # them as children of this unit).
          CapabilityBoundingSet = "";
          AmbientCapabilities = "";
          NoNewPrivileges = true;
          ProtectSystem = "strict";
          ProtectHome = true;
          PrivateTmp = true;
          PrivateDevices = true;
          PrivateUsers = true;
          PrivateMounts = true;
          ProtectClock = true;
          ProtectHostname = true;
          ProtectKernelLogs = true;
          ProtectKernelModules = true;
          ProtectKernelTunables = true;
          ProtectControlGroups = true;
          ProtectProc = "invisible";
          LockPersonality = true;
          RestrictRealtime = true;
          RestrictSUIDSGID = true;
          RestrictNamespaces = true;
          RemoveIPC = true;
          SystemCallArchitectures = "native";
          SystemCallFilter = [
            "@system-service"
            "~@privileged"
          ];
          # A job calling a filtered syscall (chown, ptrace, mount, …) gets EPERM instead of
          # being killed with SIGSYS.
          SystemCallErrorNumber = "EPERM";
          # Relaxations, each needed so executors can run jobs:
          # - MemoryDenyWriteExecute stays off: Node.js (JavaScript actions) JIT-compiles into
          #   writable+executable memory and aborts without it.
          MemoryDenyWriteExecute = false;
          # - No ProcSubset = "pid": tools in jobs read /proc/cpuinfo, /proc/meminfo and
          #   /proc/sys (Node's os.cpus(), nproc, JVMs); ProtectProc = "invisible" still hides
          #   other users' processes.
          # - AF_UNIX for the per-executor SPIFFE Workload API sockets; AF_NETLINK because
          #   the official runner (Go) enumerates interfaces to find its outbound address.
          RestrictAddressFamilies = [
            "AF_UNIX"
            "AF_INET"
            "AF_INET6"
            "AF_NETLINK"
          ];
        };
      };

      networking.firewall.allowedTCPPorts = mkIf cfg.openFirewall [
        (portOf cfg.settings.runner_facade_listen 8443)
        (portOf cfg.settings.health_listen 9090)
      ];

      users.users = mkIf (!cfg.dynamicUser && cfg.user == "gitea-dynamic-runner") {
        gitea-dynamic-runner = {
          isSystemUser = true;
          group = cfg.group;
          home = stateDir;
          description = "gitea-dynamic-runner controller";
        };
      };
      users.groups = mkIf (!cfg.dynamicUser && cfg.group == "gitea-dynamic-runner") {
        gitea-dynamic-runner = { };
      };
    }

    (mkIf cfg.nats.enable {
      assertions = [
        {
          assertion = cfg.natsProducerPasswordFile != null && cfg.natsWorkerPasswordFile != null;
          message = "services.gitea-dynamic-runner.nats.enable needs natsProducerPasswordFile and natsWorkerPasswordFile (the local NATS requires credentials, DESIGN invariant 21).";
        }
        {
          assertion = !(lib.elem natsUsers.producer adminNatsUsers || lib.elem natsUsers.worker adminNatsUsers);
          message = "services.gitea-dynamic-runner.nats.enable adds the NATS users ${natsUsers.producer} and ${natsUsers.worker}; services.nats.settings.authorization.users must not define them too.";
        }
      ];

      services.gitea-dynamic-runner.settings.nats_url = mkDefault "nats://127.0.0.1:${toString cfg.nats.port}";

      services.nats = {
        enable = true;
        jetstream = true;
        port = cfg.nats.port;
        settings.host = mkDefault "127.0.0.1";
      };

      systemd.services.nats.serviceConfig = {
        LoadCredential = [
          "producer-password:${cfg.natsProducerPasswordFile}"
          "worker-password:${cfg.natsWorkerPasswordFile}"
        ];
        RuntimeDirectory = [ (lib.removePrefix "/run/" natsRuntimeDir) ];
        RuntimeDirectoryMode = "0700";
        # See natsStart: services.nats' settings plus the two users, checked, then run.
        ExecStart = lib.mkForce "${natsStart}";
      };
    })
  ]);
}
