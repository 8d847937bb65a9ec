# Every configuration key of the binary that names a file, sorted into secrets and public files.
#
# Pure data (no arguments): nix/module.nix builds its credential options and LoadCredential
# lines from `secrets` (all but the registration token, which the unit hands over only until
# the first start has registered, see nix/module.nix), and tests/nix.rs checks that every `*_file`/`*_files` key of
# `check-config --reference` appears here exactly once, so a new secret key cannot reach the
# binary without the module learning how to deliver it. Keep one entry per line.
#
# - key: the TOML key (its environment variable is the upper-case form)
# - option: the module option under services.gitea-dynamic-runner that takes the file
# - credential: the systemd credential name (the file appears as $CREDENTIALS_DIRECTORY/<name>)
# - list: the key takes several files (comma-separated); credentials are <name>-0, <name>-1, …
{
  secrets = [
    { key = "gitea_runner_token_file"; option = "runnerTokenFile"; credential = "runner-token"; list = false; }
    { key = "runner_facade_capability_key_file"; option = "capabilityKeyFile"; credential = "capability-key"; list = false; }
    { key = "task_encryption_key_file"; option = "taskEncryptionKeyFile"; credential = "task-encryption-key"; list = false; }
    { key = "task_encryption_previous_key_files"; option = "taskEncryptionPreviousKeyFiles"; credential = "task-encryption-previous-key"; list = true; }
    { key = "nats_producer_password_file"; option = "natsProducerPasswordFile"; credential = "nats-producer-password"; list = false; }
    { key = "nats_producer_creds_file"; option = "natsProducerCredsFile"; credential = "nats-producer-creds"; list = false; }
    { key = "nats_worker_password_file"; option = "natsWorkerPasswordFile"; credential = "nats-worker-password"; list = false; }
    { key = "nats_worker_creds_file"; option = "natsWorkerCredsFile"; credential = "nats-worker-creds"; list = false; }
    { key = "opensandbox_api_key_file"; option = "opensandboxApiKeyFile"; credential = "opensandbox-api-key"; list = false; }
    { key = "gitea_runner_registration_token_file"; option = "registrationTokenFile"; credential = "registration-token"; list = false; }
  ];

  # Files that are not secret (CA bundles, the runner UUID): ordinary settings, which may
  # point into the Nix store.
  public = [
    "gitea_runner_uuid_file"
    "gitea_ca_file"
    "nats_ca_file"
    "opensandbox_ca_file"
  ];
}
