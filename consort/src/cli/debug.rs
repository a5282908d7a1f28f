//! `consort debug`: looking into a failed job (`consort debug flight DIR`).

use clap::Subcommand;

type BoxError = Box<dyn std::error::Error>;

/// What `consort debug` looks into.
#[derive(Debug, Subcommand)]
pub(crate) enum DebugCommand {
    /// Merge the flight records (`rank-K.json`) in DIR: `consort run`
    /// writes them to `<log dir>/attempt_N/flight/` when a job fails (or a
    /// worker gets SIGUSR1).
    Flight {
        /// The directory of `rank-K.json` files.
        dir: std::path::PathBuf,
    },
}

/// Runs `consort debug`.
pub(crate) fn run(what: DebugCommand) -> Result<(), BoxError> {
    match what {
        DebugCommand::Flight { dir } => {
            for line in consort::launch::records::verdict(&dir)? {
                println!("{line}");
            }
        }
    }
    Ok(())
}
