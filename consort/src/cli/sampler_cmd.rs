//! `consort sampler`: one rank's DistributedSampler indices as JSON.

use crate::flags::parse_mode;

type BoxError = Box<dyn std::error::Error>;

/// `consort sampler`'s flags.
#[derive(Debug, clap::Args)]
pub(crate) struct SamplerArgs {
    /// Dataset length.
    #[arg(long)]
    len: u64,
    /// World size.
    #[arg(long)]
    num_replicas: usize,
    /// This rank.
    #[arg(long)]
    rank: usize,
    /// Seed (torch's default is 0).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Epoch (set_epoch).
    #[arg(long, default_value_t = 0)]
    epoch: u64,
    /// Shuffle (true|false).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    shuffle: bool,
    /// Drop the tail instead of padding (true|false).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    drop_last: bool,
    /// exact (PyTorch's order) or streaming (Feistel, O(1) memory).
    #[arg(long, default_value = "exact")]
    mode: String,
}

/// Prints the indices.
pub(crate) fn run(a: SamplerArgs) -> Result<(), BoxError> {
    let mut s = consort::sampler::DistributedSampler::new(
        a.len,
        a.num_replicas,
        a.rank,
        a.shuffle,
        a.seed,
        a.drop_last,
    )?
    .with_mode(parse_mode(&a.mode)?);
    s.set_epoch(a.epoch);
    println!("{}", serde_json::to_string(&s.indices()?)?);
    Ok(())
}
