//! The `consort` command line: one file per subcommand (`version`,
//! `store_cmd`, `debug`, `run`, `bench_cmd`, `sampler_cmd`, `sim`) and the
//! hidden helpers consort starts itself (`helper`, `init_check`,
//! `mismatch`). Each parses its flags and hands the work to the library or
//! to the benches ([`crate::bench`]).

mod bench_cmd;
mod debug;
mod gpus;
mod helper;
mod init_check;
mod mismatch;
mod run;
mod sampler_cmd;
mod sim;
mod store_cmd;
mod version;

use clap::{Parser, Subcommand};

/// consort: collective communication and data-parallel training for Rust.
#[derive(Debug, Parser)]
#[command(name = "consort", version, about, long_about = None)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the version and the backends compiled in.
    Version(version::VersionArgs),
    /// Run a TCPStore server (PyTorch wire-compatible) until interrupted.
    Store(store_cmd::StoreArgs),
    /// Look into a failed job: `consort debug flight DIR` merges the ranks'
    /// flight records and names who is behind, in which call.
    Debug {
        #[command(subcommand)]
        what: debug::DebugCommand,
    },
    /// Launch workers like torchrun: `consort run --nproc-per-node 4 --
    /// program args...` (RANK, WORLD_SIZE, MASTER_ADDR, ... set for each).
    Run(run::RunArgs),
    /// Benchmark collectives (N ranks on loopback, nccl-tests style), or,
    /// with a subcommand, measure this machine.
    Bench(bench_cmd::BenchArgs),
    /// Print one rank's sample indices as a JSON array (DistributedSampler).
    Sampler(sampler_cmd::SamplerArgs),
    /// Predict collective time on an α–β model of a cluster (cost-only
    /// simulator), nccl-tests style, with the closed form beside each row.
    Sim(sim::SimCmd),
    #[command(flatten)]
    Helper(helper::Helper),
}

/// Runs one command; the exit code is the launcher's (a failed worker's
/// code) for `consort run`, and success for the others.
pub(crate) async fn run(cli: Cli) -> Result<std::process::ExitCode, Box<dyn std::error::Error>> {
    match cli.command {
        Command::Run(args) => {
            let code = run::run(args).await?;
            return Ok(std::process::ExitCode::from(code.clamp(0, 255) as u8));
        }
        Command::Version(a) => version::run(a),
        Command::Store(a) => store_cmd::run(a).await?,
        Command::Debug { what } => debug::run(what)?,
        Command::Bench(a) => bench_cmd::run(a).await?,
        Command::Sampler(a) => sampler_cmd::run(a)?,
        Command::Sim(a) => sim::command(a).await?,
        Command::Helper(h) => helper::run(h).await?,
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
