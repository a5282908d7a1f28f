//! The `consort` command line: subcommands, flag parsing, and output.

mod bench;
mod table;

use clap::{Parser, Subcommand};
use consort::{DType, TcpStoreServer};
use serde_json::json;

use table::Table;

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
    Version {
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run a TCPStore server (PyTorch wire-compatible) until interrupted.
    #[command(subcommand)]
    Store(StoreCommand),
    /// Measure this machine.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Debug, Subcommand)]
enum StoreCommand {
    /// Serve a store that torch and consort processes can both use.
    Serve {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// Port to listen on (0 picks a free one and prints it).
        #[arg(long, default_value_t = 29500)]
        port: u16,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// ReduceOp::Sum apply throughput per dtype, beside memcpy.
    Reduce {
        /// Buffer sizes in bytes of dst, with K/M/G suffixes.
        #[arg(long, default_value = "256K,64M", value_parser = parse_sizes)]
        sizes: SizeList,
        /// Dtypes: f32, f64, f16, bf16, i8, u8, i32, i64, u32, u64.
        #[arg(long, default_value = "f32,f16,bf16", value_parser = parse_dtypes)]
        dtypes: DTypeList,
        /// Timed runs per cell (the median is reported).
        #[arg(long, default_value_t = 30)]
        iters: usize,
        /// One JSON object per row.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Clone)]
struct SizeList(Vec<usize>);

#[derive(Debug, Clone)]
struct DTypeList(Vec<DType>);

/// Parses `4K,64M,1G` (binary multiples) into byte counts.
fn parse_sizes(s: &str) -> Result<SizeList, String> {
    s.split(',')
        .map(|item| {
            let item = item.trim();
            let (num, mult) = match item.chars().last().map(|c| c.to_ascii_uppercase()) {
                Some('K') => (&item[..item.len() - 1], 1usize << 10),
                Some('M') => (&item[..item.len() - 1], 1 << 20),
                Some('G') => (&item[..item.len() - 1], 1 << 30),
                _ => (item, 1),
            };
            num.parse::<usize>()
                .ok()
                .and_then(|n| n.checked_mul(mult))
                .ok_or_else(|| format!("bad size {item:?}: expected a number with an optional K, M or G suffix, like 4K or 1G"))
        })
        .collect::<Result<_, _>>()
        .map(SizeList)
}

/// Parses a comma-separated dtype list (`f32` or `float32` style).
fn parse_dtypes(s: &str) -> Result<DTypeList, String> {
    s.split(',')
        .map(|item| {
            let item = item.trim();
            DType::ALL
                .into_iter()
                .find(|d| {
                    d.name() == item || format!("{d:?}").eq_ignore_ascii_case(item)
                })
                .ok_or_else(|| format!("unknown dtype {item:?}: expected one of f32, f64, f16, bf16, i8, u8, i32, i64, u32, u64"))
        })
        .collect::<Result<_, _>>()
        .map(DTypeList)
}

/// Backends compiled into this build.
fn backends() -> Vec<&'static str> {
    vec!["tcp-store"]
}

pub(crate) async fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        Command::Version { json } => {
            let v = env!("CARGO_PKG_VERSION");
            if json {
                println!(
                    "{}",
                    json!({"name": "consort", "version": v, "backends": backends()})
                );
            } else {
                println!("consort {v} (backends: {})", backends().join(", "));
            }
        }
        Command::Store(StoreCommand::Serve { host, port }) => {
            let server = TcpStoreServer::bind(format!("{host}:{port}").as_str()).await?;
            println!("TCPStore listening on {}", server.local_addr());
            tokio::signal::ctrl_c().await?;
            server.shutdown().await;
        }
        Command::Bench(BenchCommand::Reduce {
            sizes,
            dtypes,
            iters,
            json,
        }) => {
            let t: Table =
                tokio::task::spawn_blocking(move || bench::reduce(&sizes.0, &dtypes.0, iters))
                    .await?;
            print!("{}", t.render(json));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_dtypes_parse() {
        assert_eq!(parse_sizes("4K,1G,7").unwrap().0, vec![4096, 1 << 30, 7]);
        assert!(parse_sizes("4X").is_err());
        assert!(parse_sizes("").is_err());
        assert!(parse_sizes("99999999999999999G").is_err());
        assert_eq!(
            parse_dtypes("f32,bfloat16").unwrap().0,
            vec![DType::F32, DType::BF16]
        );
        assert!(parse_dtypes("f8").unwrap_err().contains("unknown dtype"));
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
