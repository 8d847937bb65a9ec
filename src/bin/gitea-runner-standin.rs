//! `gitea-runner-standin daemon --once`: a test stand-in for the official Gitea runner
//! (built only with the `testkit` feature). The logic and its script convention live in
//! `gdr_testkit::standin_runner`.

fn main() -> std::process::ExitCode {
    gdr_testkit::standin_runner::main()
}
