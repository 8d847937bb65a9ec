//! Command-line interface. `--help` on each subcommand is the user documentation.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::settings::{
    self, Format, RegisterSettings, SandboxIdentitySettings, Settings, SettingsError, Sources,
};

/// Claims Gitea Actions jobs through Gitea's runner protocol, queues each one in NATS
/// JetStream and runs it in a fresh Kubernetes Pod or Kata microVM with a SPIFFE
/// workload identity. Executors never see the controller's Gitea credential.
#[derive(Debug, Parser)]
#[command(name = "gitea-dynamic-runner", version, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// Parses the process arguments (exits with usage on error, as clap does).
    pub fn parse_args() -> Self {
        Self::parse()
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the controller components (scheduler with facade, pod-worker, vm-worker).
    ///
    /// On one host `controller --gitea-url URL --registration-token-file FILE` is the whole
    /// set-up: the first start registers the runner and writes its credential and keys
    /// under state_dir (mode 0600); later starts reuse them.
    #[command(after_long_help = reference())]
    Controller(ControllerArgs),
    /// Run inside a Pod or VM: serve the loopback proxy to the facade and run the
    /// official runner once (`daemon --once`).
    Executor,
    /// Run in the sandbox cluster: keep SPIRE ClusterStaticEntries in step with
    /// OpenSandbox runner sandboxes (keys: trust_domain, metadata_prefix,
    /// opensandbox_namespace, spire_cluster_name, spire_class_name, runner_uid,
    /// sandbox_identity_resync, health_listen and the leader election keys with
    /// sandbox_identity_lease_name). Needs a kube client (in-cluster or KUBECONFIG) and no
    /// other credential.
    #[command(after_long_help = reference())]
    SandboxIdentity(ConfigArgs),
    /// Register the controller's own runner in Gitea (once), writing the UUID and
    /// token files named by gitea_runner_uuid_file and gitea_runner_token_file.
    #[command(after_long_help = reference())]
    Register(RegisterArgs),
    /// Load the configuration, print it (secrets are only shown as file paths) and
    /// report every problem; exits non-zero when there is one.
    #[command(after_long_help = reference())]
    CheckConfig(CheckConfigArgs),
    /// Show what a running controller is doing: per backend its capacity, running,
    /// starting and queued jobs; per job its phase, age and last event (from `/status` on
    /// the health listener).
    Status(StatusArgs),
    /// Print the reference of every metric the controller exports (docs/metrics.md).
    Metrics(MetricsArgs),
    /// Print the version.
    Version,
    /// Internal: run PROGRAM so that it dies with the process that started it (the
    /// controller starts its embedded nats-server this way).
    #[command(name = "exec-bound-to-parent", hide = true)]
    ExecBoundToParent(BoundArgs),
}

/// `exec-bound-to-parent` arguments.
#[derive(Debug, Args)]
pub struct BoundArgs {
    /// The pid of the process PROGRAM must not outlive.
    #[arg(long)]
    pub parent: u32,
    /// The program and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    pub program: Vec<std::ffi::OsString>,
}

/// `exec-bound-to-parent`: becomes PROGRAM, or fails.
pub fn exec_bound_to_parent(args: BoundArgs) -> ExitCode {
    fail(crate::runtime::exec_bound_to_parent(
        args.parent,
        &args.program,
    ))
}

/// Where the configuration comes from.
#[derive(Debug, Clone, Args)]
pub struct ConfigArgs {
    /// TOML configuration file (keys as in the reference below).
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override one key, applied after the file and the environment (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

impl ConfigArgs {
    /// The configuration sources these flags describe (with the environment).
    pub fn sources(&self) -> Result<Sources, SettingsError> {
        Ok(Sources {
            file: self.config.clone(),
            overrides: self
                .set
                .iter()
                .map(|s| Sources::parse_override(s))
                .collect::<Result<_, _>>()?,
            environment: true,
        })
    }
}

/// `controller` flags.
#[derive(Debug, Clone, Args)]
pub struct ControllerArgs {
    /// Configuration sources.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Base URL of the Gitea instance (sets gitea_instance_url, as --set would).
    #[arg(long, value_name = "URL")]
    pub gitea_url: Option<String>,
    /// File holding a registration token from Gitea's runner settings page: registers on
    /// the first start (sets gitea_runner_registration_token_file, as --set would).
    #[arg(long, value_name = "FILE")]
    pub registration_token_file: Option<PathBuf>,
}

impl ControllerArgs {
    /// The configuration sources: the flags are overrides, before any `--set`.
    pub fn sources(&self) -> Result<Sources, SettingsError> {
        let mut sources = self.config.sources()?;
        let flags = [
            ("gitea_instance_url", self.gitea_url.clone()),
            (
                "gitea_runner_registration_token_file",
                self.registration_token_file
                    .as_ref()
                    .map(|p| p.display().to_string()),
            ),
        ];
        let flags = flags
            .into_iter()
            .filter_map(|(key, value)| value.map(|v| (key.to_owned(), v)));
        sources.overrides = flags.chain(sources.overrides).collect();
        Ok(sources)
    }
}

/// `register` flags.
#[derive(Debug, Args)]
pub struct RegisterArgs {
    /// Configuration (gitea_instance_url and the two output file paths come from it).
    #[command(flatten)]
    pub config: ConfigArgs,
    /// File holding the registration token from Gitea's runner settings page.
    #[arg(
        long,
        value_name = "FILE",
        env = "GITEA_RUNNER_REGISTRATION_TOKEN_FILE"
    )]
    pub registration_token_file: PathBuf,
    /// Runner name shown in Gitea (default: runner_name from the configuration).
    #[arg(long)]
    pub name: Option<String>,
    /// Labels to register, comma-separated (default: self-hosted plus the enabled
    /// backend labels, e.g. self-hosted,pod,vm).
    #[arg(long, value_delimiter = ',')]
    pub labels: Option<Vec<String>>,
    /// Overwrite existing UUID and token files (the old runner stays in Gitea until
    /// removed there).
    #[arg(long)]
    pub force: bool,
}

/// `check-config` flags.
#[derive(Debug, Args)]
pub struct CheckConfigArgs {
    /// Configuration sources.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Print the configuration reference (every key, its variable, type, default) and exit.
    #[arg(long)]
    pub reference: bool,
    /// Format of `--reference`: text, markdown (docs/configuration.md), nix (the NixOS
    /// module's options) or json.
    #[arg(long, value_enum, default_value = "text", requires = "reference")]
    pub format: Format,
}

/// `status` flags.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Base URL of the controller's health listener (health_listen).
    #[arg(long, value_name = "URL", default_value = crate::settings::DEFAULT_STATUS_URL)]
    pub url: String,
    /// Print the `/status` JSON document instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// `metrics` flags.
#[derive(Debug, Args)]
pub struct MetricsArgs {
    /// Format: text, markdown (docs/metrics.md) or json.
    #[arg(long, value_enum, default_value = "text")]
    pub format: crate::metrics::ReferenceFormat,
}

/// `metrics`: prints the metrics reference, generated from the registry itself.
pub fn metrics(args: &MetricsArgs) -> ExitCode {
    print!("{}", crate::runtime::metrics::reference(args.format));
    ExitCode::SUCCESS
}

/// `status`: reads `/status` from a controller and prints it.
pub fn status(args: &StatusArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    match runtime.block_on(crate::status::client::fetch(&args.url)) {
        Ok(report) if args.json => match serde_json::to_string_pretty(&report) {
            Ok(json) => {
                println!("{json}");
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        Ok(report) => {
            print!("{}", crate::status::table::render(&report));
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

/// The configuration reference appended to `--help`.
fn reference() -> String {
    settings::reference(Format::Text)
}

/// `check-config`: prints the effective configuration and every problem.
pub fn check_config(args: CheckConfigArgs) -> ExitCode {
    if args.reference {
        print!("{}", settings::reference(args.format));
        return ExitCode::SUCCESS;
    }
    let checked = match args.config.sources().and_then(|s| settings::check(&s)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("configuration error:\n{e}");
            return ExitCode::FAILURE;
        }
    };
    print!("{}", checked.rendered);
    if checked.problems.is_empty() {
        eprintln!("configuration OK");
        ExitCode::SUCCESS
    } else {
        eprintln!("{} problem(s):", checked.problems.len());
        for p in &checked.problems {
            eprintln!("  - {p}");
        }
        ExitCode::FAILURE
    }
}

/// `register`: registers the controller's runner and prints the next steps.
pub fn register(args: RegisterArgs) -> ExitCode {
    let settings = match args
        .config
        .sources()
        .and_then(|s| RegisterSettings::load(&s))
    {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let registration = match crate::register::prepare(
        settings,
        &args.registration_token_file,
        args.name,
        args.labels,
        args.force,
    ) {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    match runtime.block_on(crate::register::run(&registration)) {
        Ok(registered) => {
            print!(
                "{}",
                crate::register::next_steps(&registration, &registered)
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

/// The controller's settings from its flags (and the environment); prints the problems and
/// fails when they are unusable.
pub fn controller_settings(args: &ControllerArgs) -> Result<Settings, ExitCode> {
    load(args.sources(), Settings::load)
}

/// `sandbox-identity`'s settings, as [`controller_settings`].
pub fn sandbox_identity_settings(args: &ConfigArgs) -> Result<SandboxIdentitySettings, ExitCode> {
    load(args.sources(), SandboxIdentitySettings::load)
}

fn load<T>(
    sources: Result<Sources, SettingsError>,
    load: impl FnOnce(&Sources) -> Result<T, SettingsError>,
) -> Result<T, ExitCode> {
    sources.and_then(|s| load(&s)).map_err(|e| {
        eprintln!("configuration error:\n{e}");
        ExitCode::FAILURE
    })
}

/// Prints `error: …` and fails.
pub fn fail(error: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {error}");
    ExitCode::FAILURE
}
