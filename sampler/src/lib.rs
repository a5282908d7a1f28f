//! consort-sampler: which sample indices each rank reads.
//!
//! This crate owns data sharding, and depends on nothing else in consort:
//!
//! - [`DistributedSampler`]: bit-exact with `torch.utils.data.
//!   DistributedSampler`: MT19937 `randperm` (both of ATen's paths), padding
//!   by repetition, `drop_last` truncation, `rank::num_replicas`
//!   subsampling. In [`Mode::Streaming`] it uses a keyed Feistel permutation
//!   instead: O(1) memory and O(1) random access, same shard shapes.
//! - [`BatchSampler`]: per-rank batches, with `skip` to resume mid-epoch.
//! - [`EvalSampler`]: shards without padding, for evaluation.
//!
//! # Padding skews evaluation
//!
//! When `len` is not a multiple of `num_replicas` and `drop_last` is off,
//! the sampler repeats the first `total - len` indices so that every rank
//! gets the same count (collectives need that). Those samples are then
//! counted twice: fine for training, wrong for a validation metric. Use
//! [`EvalSampler`] for evaluation, and weight each rank's metric by its
//! [`EvalSampler::count`].
//!
//! # Set the epoch
//!
//! The order depends on `seed + epoch`. Without [`DistributedSampler::set_epoch`]
//! every epoch repeats the same order (PyTorch's most common sampler bug).

mod feistel;
pub mod mt;

pub use feistel::Feistel;
pub use mt::{Mt19937, randperm};

/// A bad sampler configuration.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SamplerError {
    /// `num_replicas` is 0.
    #[error("num_replicas must be at least 1 (it is the world size)")]
    NoReplicas,
    /// `rank` is not below `num_replicas`.
    #[error("rank {rank} is out of range for num_replicas {num_replicas} (valid: 0..={})", num_replicas.saturating_sub(1))]
    BadRank {
        /// The rank given.
        rank: usize,
        /// The world size.
        num_replicas: usize,
    },
    /// The batch size is 0.
    #[error("batch_size must be at least 1")]
    NoBatch,
    /// The dataset does not fit this machine's address space.
    #[error("a dataset of {0} samples does not fit in usize on this machine")]
    TooLarge(u64),
}

/// How the order is produced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// PyTorch's exact order (an O(len) permutation per epoch).
    #[default]
    Exact,
    /// A keyed Feistel permutation: O(1) memory, O(1) random access; not
    /// PyTorch's order.
    Streaming,
}

fn check(num_replicas: usize, rank: usize) -> Result<(), SamplerError> {
    if num_replicas == 0 {
        return Err(SamplerError::NoReplicas);
    }
    if rank >= num_replicas {
        return Err(SamplerError::BadRank { rank, num_replicas });
    }
    Ok(())
}

/// `torch.utils.data.DistributedSampler`, index for index.
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    len: u64,
    num_replicas: u64,
    rank: u64,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
    mode: Mode,
    /// The epoch's permutation (exact mode, shuffled), built on first use.
    perm: Option<(u64, Vec<u64>)>,
}

impl DistributedSampler {
    /// A sampler over `len` samples for `rank` of `num_replicas`, as torch's
    /// `DistributedSampler(dataset, num_replicas, rank, shuffle, seed,
    /// drop_last)`; epoch 0, exact mode.
    pub fn new(
        len: u64,
        num_replicas: usize,
        rank: usize,
        shuffle: bool,
        seed: u64,
        drop_last: bool,
    ) -> Result<Self, SamplerError> {
        check(num_replicas, rank)?;
        Ok(DistributedSampler {
            len,
            num_replicas: num_replicas as u64,
            rank: rank as u64,
            shuffle,
            seed,
            drop_last,
            epoch: 0,
            mode: Mode::Exact,
            perm: None,
        })
    }

    /// Returns the sampler in `mode`.
    #[must_use]
    pub fn with_mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self.perm = None;
        self
    }

    /// Sets the epoch: the order depends on `seed + epoch`. Call it at the
    /// start of every epoch, as in PyTorch.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// Samples per rank (torch's `num_samples`).
    pub fn len(&self) -> u64 {
        let (n, r) = (self.len, self.num_replicas);
        if self.drop_last && n % r != 0 {
            n / r
        } else {
            n.div_ceil(r)
        }
    }

    /// Whether this rank gets no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Samples over all ranks, after padding or truncation.
    pub fn total_size(&self) -> u64 {
        self.len() * self.num_replicas
    }

    fn key(&self) -> u64 {
        self.seed.wrapping_add(self.epoch)
    }

    /// Index `i` (< `len()`) of this rank's shard, in O(1) for streaming
    /// mode and unshuffled samplers, O(len) once per epoch in exact mode.
    pub fn get(&mut self, i: u64) -> Option<u64> {
        if i >= self.len() {
            return None;
        }
        // Position in the padded (or truncated) global order, then back into
        // the dataset: padding repeats the order from its start.
        let j = (self.rank + i * self.num_replicas) % self.len.max(1);
        Some(self.order(j))
    }

    /// Element `j` (< len) of the epoch's global order.
    fn order(&mut self, j: u64) -> u64 {
        if !self.shuffle {
            return j;
        }
        match self.mode {
            Mode::Streaming => Feistel::new(self.len, self.key()).permute(j),
            Mode::Exact => {
                let key = self.key();
                if self.perm.as_ref().is_none_or(|(k, _)| *k != key) {
                    let n = usize::try_from(self.len).expect("checked in indices");
                    self.perm = Some((key, randperm(n, key)));
                }
                self.perm.as_ref().expect("just built").1[j as usize]
            }
        }
    }

    /// This rank's indices for the current epoch.
    pub fn indices(&mut self) -> Result<Vec<u64>, SamplerError> {
        if self.mode == Mode::Exact && self.shuffle && usize::try_from(self.len).is_err() {
            return Err(SamplerError::TooLarge(self.len));
        }
        let count = self.len();
        let mut out = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
        for i in 0..count {
            out.push(self.get(i).expect("i < len"));
        }
        Ok(out)
    }

    /// An iterator over this rank's indices from position `start` (for a run
    /// resumed mid-epoch).
    pub fn iter_from(&mut self, start: u64) -> impl Iterator<Item = u64> + '_ {
        (start..self.len()).map(move |i| self.get(i).expect("i < len"))
    }
}

/// Per-rank batches over a [`DistributedSampler`].
#[derive(Debug)]
pub struct BatchSampler {
    sampler: DistributedSampler,
    batch_size: u64,
    drop_last: bool,
    next: u64,
}

impl BatchSampler {
    /// Batches of `batch_size`; the last, short batch is dropped when
    /// `drop_last`.
    pub fn new(
        sampler: DistributedSampler,
        batch_size: usize,
        drop_last: bool,
    ) -> Result<Self, SamplerError> {
        if batch_size == 0 {
            return Err(SamplerError::NoBatch);
        }
        Ok(BatchSampler {
            sampler,
            batch_size: batch_size as u64,
            drop_last,
            next: 0,
        })
    }

    /// Batches per epoch.
    pub fn len(&self) -> u64 {
        let n = self.sampler.len();
        if self.drop_last {
            n / self.batch_size
        } else {
            n.div_ceil(self.batch_size)
        }
    }

    /// Whether there are no batches.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resumes after `k` samples of this rank's shard (from a checkpoint),
    /// without replaying them.
    pub fn skip(&mut self, k: u64) {
        self.next = k.min(self.sampler.len());
    }

    /// Starts epoch `epoch` from its beginning.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.sampler.set_epoch(epoch);
        self.next = 0;
    }
}

impl Iterator for BatchSampler {
    type Item = Vec<u64>;

    fn next(&mut self) -> Option<Vec<u64>> {
        let n = self.sampler.len();
        if self.next >= n {
            return None;
        }
        let end = (self.next + self.batch_size).min(n);
        if self.drop_last && end - self.next < self.batch_size {
            return None;
        }
        let batch = (self.next..end)
            .map(|i| self.sampler.get(i).expect("i < len"))
            .collect();
        self.next = end;
        Some(batch)
    }
}

/// Shards for evaluation: every sample exactly once over all ranks, no
/// padding, so ranks may get different counts (`rank`, `rank + R`, ...).
#[derive(Clone, Debug)]
pub struct EvalSampler {
    len: u64,
    num_replicas: u64,
    rank: u64,
}

impl EvalSampler {
    /// The shard of `rank` of `num_replicas` over `len` samples.
    pub fn new(len: u64, num_replicas: usize, rank: usize) -> Result<Self, SamplerError> {
        check(num_replicas, rank)?;
        Ok(EvalSampler {
            len,
            num_replicas: num_replicas as u64,
            rank: rank as u64,
        })
    }

    /// How many samples this rank evaluates (weight its metric by this).
    pub fn count(&self) -> u64 {
        if self.rank >= self.len {
            0
        } else {
            (self.len - self.rank).div_ceil(self.num_replicas)
        }
    }

    /// This rank's indices.
    pub fn indices(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.count()).map(move |i| self.rank + i * self.num_replicas)
    }
}
