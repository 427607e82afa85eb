//! `idempotent`: list scopes, audit a store, purge expired records.
//! Run `idempotent --help`. All the logic lives in `idempotent_runtime::cli`.

use idempotent_runtime::cli::{parse_command_line, run, CliError};
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = parse_command_line(); // prints usage / --help / --version and exits on its own
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
    match runtime.block_on(run(cli)) {
        Ok(output) => {
            print!("{output}");
            ExitCode::SUCCESS
        }
        Err(e @ CliError::AuditFindings { .. }) => {
            if let CliError::AuditFindings { report } = &e {
                print!("{report}");
            }
            eprintln!("idempotent: {e}");
            ExitCode::from(3)
        }
        Err(e) => {
            eprintln!("idempotent: {e}");
            ExitCode::FAILURE
        }
    }
}
