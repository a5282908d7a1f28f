//! Hidden helper commands that consort starts itself (bench peers and
//! ranks), kept apart from the user's subcommands.

use clap::Subcommand;

use super::{init_check, mismatch};
use crate::bench::{collective, machine};

type BoxError = Box<dyn std::error::Error>;

/// The helpers, flattened into the command line but hidden from `--help`.
#[derive(Debug, Subcommand)]
pub(crate) enum Helper {
    /// The peer process of `consort bench loopback` (started by it).
    #[command(hide = true)]
    BenchLoopbackPeer {
        /// Port to connect to.
        port: u16,
        /// Bytes each way.
        bytes: usize,
        /// oneway or duplex.
        mode: String,
    },
    /// One rank of `consort bench --backend tcp` (started by it).
    #[command(hide = true)]
    BenchWorker {
        /// The bench spec, as JSON.
        spec: String,
    },
    /// One rank of the mismatch self-test (`consort run ... -- consort
    /// mismatch-check --backend nccl`, started by scripts/gpu-check).
    #[command(hide = true)]
    MismatchCheck {
        /// tcp, quic, nccl or emulated.
        #[arg(long, default_value = "tcp")]
        backend: String,
        /// mismatch (rank 0 all_reduces one element more), or cancelled
        /// (rank 0 drops its all_reduce before awaiting it: on TCP and QUIC
        /// every peer must hear why; on NCCL and the emulated device the
        /// call runs to its end everywhere).
        #[arg(long, default_value = "mismatch")]
        case: String,
    },
    /// One rank of the bounded-init self-test (`consort run ... -- consort
    /// init-check --backend nccl`, started by scripts/gpu-check): rank
    /// `--absent` never inits, the others must fail within CONSORT_TIMEOUT.
    #[command(hide = true)]
    InitCheck {
        /// tcp, quic, nccl or emulated.
        #[arg(long, default_value = "tcp")]
        backend: String,
        /// The rank that stays out of the init.
        #[arg(long, default_value_t = 1)]
        absent: usize,
    },
}

/// Runs a helper.
pub(crate) async fn run(h: Helper) -> Result<(), BoxError> {
    match h {
        Helper::BenchWorker { spec } => collective::worker(&spec).await?,
        Helper::MismatchCheck { backend, case } => match case.as_str() {
            "mismatch" => mismatch::run(&backend).await?,
            "cancelled" => mismatch::cancelled(&backend).await?,
            other => {
                return Err(format!("--case {other}: expected mismatch or cancelled").into());
            }
        },
        Helper::InitCheck { backend, absent } => init_check::run(&backend, absent).await?,
        Helper::BenchLoopbackPeer { port, bytes, mode } => {
            tokio::task::spawn_blocking(move || {
                machine::loopback_peer(port, bytes, mode == "duplex").map_err(|e| e.to_string())
            })
            .await??;
        }
    }
    Ok(())
}
