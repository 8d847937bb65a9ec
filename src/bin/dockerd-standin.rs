//! `dockerd-standin`: a test stand-in for `dockerd` (built only with the `testkit`
//! feature). The logic lives in `gdr_testkit::standin_dockerd`.

fn main() -> std::process::ExitCode {
    gdr_testkit::standin_dockerd::main()
}
