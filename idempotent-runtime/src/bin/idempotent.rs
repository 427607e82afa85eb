//! `idempotent`: list scopes, audit a store, purge expired records.
//! Run `idempotent --help`. All the logic lives in `idempotent_runtime::cli`.

use idempotent_runtime::cli::{log_subscriber, parse_command_line, print_output, run, CliError};
use std::io::IsTerminal;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = parse_command_line(); // prints usage / --help / --version and exits on its own
    let log = log_subscriber(std::io::stderr, std::io::stderr().is_terminal());
    if let Err(e) = tracing::subscriber::set_global_default(log) {
        eprintln!("idempotent: cannot set up the log: {e}");
        return ExitCode::FAILURE;
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idempotent: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (output, status) = match runtime.block_on(run(cli)) {
        Ok(output) => (output, ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("idempotent: {e}");
            match e {
                // The report is the output all the same, with status 3.
                CliError::AuditFindings { report } => (report, ExitCode::from(3)),
                _ => return ExitCode::FAILURE,
            }
        }
    };
    match print_output(&mut std::io::stdout().lock(), &output) {
        Ok(()) => status,
        Err(e) => {
            eprintln!("idempotent: {e}");
            ExitCode::FAILURE
        }
    }
}
