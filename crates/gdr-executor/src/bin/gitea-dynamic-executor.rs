//! `gitea-dynamic-executor`: the executor on its own, without the controller's code, so
//! each job's start loads a small binary (issue 39). See [`gdr_executor::cli`].

fn main() -> std::process::ExitCode {
    gdr_executor::cli::main()
}
