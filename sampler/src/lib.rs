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
//!
//! # Example
//!
//! Ten samples over four ranks, unshuffled: every rank reads three, and
//! the two the shards are short are taken again from the start, as torch
//! pads them.
//!
//! ```
//! use consort_sampler::DistributedSampler;
//!
//! let shard = |rank| {
//!     // DistributedSampler(dataset, num_replicas=4, rank=rank, shuffle=False)
//!     let mut s = DistributedSampler::new(10, 4, rank, false, 0, false)?;
//!     s.indices()
//! };
//! assert_eq!(shard(0)?, [0, 4, 8]);
//! assert_eq!(shard(2)?, [2, 6, 0]); // 0 and 1 again: padding
//! assert_eq!(shard(3)?, [3, 7, 1]);
//! # Ok::<(), consort_sampler::SamplerError>(())
//! ```

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
    /// The dataset is too large for exact mode's in-memory permutation.
    #[error(
        "a dataset of {0} samples is too large to permute in memory (exact mode holds one \
         index per sample); use Mode::Streaming, whose permutation takes O(1) memory"
    )]
    TooLarge(u64),
    /// The padded total (`len` rounded up to a multiple of `num_replicas`)
    /// does not fit in u64.
    #[error(
        "a dataset of {len} samples over {num_replicas} replicas is too large: padded to a \
         multiple of num_replicas it passes u64::MAX"
    )]
    Overflow {
        /// The dataset length given.
        len: u64,
        /// The world size.
        num_replicas: usize,
    },
}

/// The largest dataset exact mode permutes (2^36 samples: a 512 GiB index
/// vector); larger ones need [`Mode::Streaming`].
pub const EXACT_MAX_LEN: u64 = 1 << 36;

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
///
/// Shuffled, each epoch is torch's `randperm(len)` from a generator seeded
/// with `seed + epoch`, and rank `r` takes every `num_replicas`-th index
/// from position `r`:
///
/// ```
/// use consort_sampler::DistributedSampler;
///
/// // torch.manual_seed(0); torch.randperm(10) == [4, 1, 7, 5, 3, 9, 0, 8, 6, 2]
/// let mut rank0 = DistributedSampler::new(10, 2, 0, true, 0, false)?;
/// let mut rank1 = DistributedSampler::new(10, 2, 1, true, 0, false)?;
/// assert_eq!(rank0.indices()?, [4, 7, 3, 0, 6]);
/// assert_eq!(rank1.indices()?, [1, 5, 9, 8, 2]);
///
/// rank0.set_epoch(1); // at the start of every epoch, on every rank
/// assert_ne!(rank0.indices()?, [4, 7, 3, 0, 6]);
/// # Ok::<(), consort_sampler::SamplerError>(())
/// ```
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
    /// The epoch's keyed permutation (streaming mode).
    feistel: Option<(u64, Feistel)>,
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
        let r = num_replicas as u64;
        // Padding (drop_last off) rounds len up to a multiple of r.
        if !drop_last && len.div_ceil(r).checked_mul(r).is_none() {
            return Err(SamplerError::Overflow { len, num_replicas });
        }
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
            feistel: None,
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
    /// `None` past the end, and for an exact-mode shuffle of more than
    /// [`EXACT_MAX_LEN`] samples ([`DistributedSampler::indices`] says why).
    pub fn get(&mut self, i: u64) -> Option<u64> {
        if i >= self.len() || self.too_large() {
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
            Mode::Streaming => self.feistel().permute(j),
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

    /// The streaming permutation of the current epoch.
    fn feistel(&mut self) -> Feistel {
        let key = self.key();
        match self.feistel {
            Some((k, f)) if k == key => f,
            _ => {
                let f = Feistel::new(self.len, key);
                self.feistel = Some((key, f));
                f
            }
        }
    }

    /// Whether exact mode would have to permute more than it can hold.
    fn too_large(&self) -> bool {
        self.mode == Mode::Exact
            && self.shuffle
            && (self.len > EXACT_MAX_LEN || usize::try_from(self.len).is_err())
    }

    /// This rank's indices for the current epoch.
    pub fn indices(&mut self) -> Result<Vec<u64>, SamplerError> {
        if self.too_large() {
            return Err(SamplerError::TooLarge(self.len));
        }
        let count = self.len();
        let mut out = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
        for i in 0..count {
            out.extend(self.get(i));
        }
        Ok(out)
    }

    /// An iterator over this rank's indices from position `start` (for a run
    /// resumed mid-epoch).
    pub fn iter_from(&mut self, start: u64) -> ShardIter<'_> {
        let count = self.len();
        if self.mode == Mode::Streaming && self.shuffle {
            // O(1) per index: walk the global positions by num_replicas,
            // wrapping (padding) only at the tail.
            let f = self.feistel();
            let n = self.len;
            let j = if start < count {
                (self.rank + start * self.num_replicas) % n.max(1)
            } else {
                0
            };
            return ShardIter::Streaming {
                f,
                n,
                step: self.num_replicas,
                j,
                left: count.saturating_sub(start),
            };
        }
        ShardIter::Indexed {
            sampler: self,
            next: start,
            end: count,
        }
    }
}

/// The iterator [`DistributedSampler::iter_from`] returns.
#[derive(Debug)]
pub enum ShardIter<'a> {
    /// Streaming mode: the keyed permutation, walked in O(1) per index.
    Streaming {
        /// The epoch's permutation.
        f: Feistel,
        /// Dataset length.
        n: u64,
        /// num_replicas.
        step: u64,
        /// Next global position.
        j: u64,
        /// Indices left.
        left: u64,
    },
    /// Exact mode (or no shuffle): positions looked up one by one.
    Indexed {
        /// The sampler.
        sampler: &'a mut DistributedSampler,
        /// Next shard position.
        next: u64,
        /// One past the last shard position.
        end: u64,
    },
}

impl Iterator for ShardIter<'_> {
    type Item = u64;

    #[inline]
    fn next(&mut self) -> Option<u64> {
        match self {
            ShardIter::Streaming {
                f,
                n,
                step,
                j,
                left,
            } => {
                if *left == 0 {
                    return None;
                }
                *left -= 1;
                let x = f.permute(*j);
                // (j + step) mod n, without passing u64::MAX near the top.
                let s = *step % *n;
                *j = if *j >= *n - s { *j - (*n - s) } else { *j + s };
                Some(x)
            }
            ShardIter::Indexed { sampler, next, end } => {
                if *next >= *end {
                    return None;
                }
                let x = sampler.get(*next);
                *next += 1;
                x
            }
        }
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
        if sampler.too_large() {
            return Err(SamplerError::TooLarge(sampler.len));
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

impl BatchSampler {
    /// The next batch of this rank's indices, or `None` at the end of the
    /// epoch.
    pub fn next_batch(&mut self) -> Option<Vec<u64>> {
        let n = self.sampler.len();
        if self.next >= n {
            return None;
        }
        let end = self.next.saturating_add(self.batch_size).min(n);
        if self.drop_last && end - self.next < self.batch_size {
            return None;
        }
        let batch = (self.next..end)
            .filter_map(|i| self.sampler.get(i))
            .collect();
        self.next = end;
        Some(batch)
    }

    /// The remaining batches of the epoch.
    pub fn batches(&mut self) -> impl Iterator<Item = Vec<u64>> + '_ {
        std::iter::from_fn(move || self.next_batch())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_near_u64_max_are_refused_or_served_without_panicking() {
        let e = DistributedSampler::new(u64::MAX, 4, 0, true, 0, false).unwrap_err();
        assert!(matches!(e, SamplerError::Overflow { .. }), "{e}");
        assert!(e.to_string().contains("u64::MAX"), "{e}");
        // Divisible, or dropping the tail: the total fits.
        let mut s = DistributedSampler::new(u64::MAX, 1, 0, true, 0, false).unwrap();
        assert_eq!(s.len(), u64::MAX);
        let e = s.indices().unwrap_err();
        assert!(e.to_string().contains("Mode::Streaming"), "{e}");
        assert_eq!(s.get(0), None, "exact mode cannot permute it");
        let mut s = s.with_mode(Mode::Streaming);
        let first = s.get(0).unwrap();
        assert!(first < u64::MAX);
        assert!(s.get(u64::MAX - 1).is_some());
        let mut s = DistributedSampler::new(u64::MAX, 5, 4, false, 0, true).unwrap();
        assert_eq!(s.get(s.len() - 1), Some(u64::MAX / 5 * 5 - 1));
        let e = EvalSampler::new(u64::MAX, 7, 6).unwrap();
        assert!(e.indices().next().is_some());
        // drop_last never pads: allowed; streaming walks to the very end.
        let mut s = DistributedSampler::new(u64::MAX, 2, 1, true, 9, true)
            .unwrap()
            .with_mode(Mode::Streaming);
        let n = s.len();
        assert_eq!(s.iter_from(n - 3).count(), 3);
        assert!(
            BatchSampler::new(
                DistributedSampler::new(u64::MAX, 1, 0, true, 0, false).unwrap(),
                4,
                false
            )
            .is_err(),
            "exact mode cannot batch what it cannot permute"
        );
    }

    #[test]
    fn bad_configurations_are_errors_not_panics() {
        assert_eq!(
            DistributedSampler::new(10, 0, 0, true, 0, false).unwrap_err(),
            SamplerError::NoReplicas
        );
        let e = DistributedSampler::new(10, 4, 4, true, 0, false).unwrap_err();
        assert_eq!(
            e.to_string(),
            "rank 4 is out of range for num_replicas 4 (valid: 0..=3)"
        );
        assert!(EvalSampler::new(10, 2, 2).is_err());
        let s = DistributedSampler::new(10, 2, 0, false, 0, false).unwrap();
        assert_eq!(
            BatchSampler::new(s, 0, false).unwrap_err(),
            SamplerError::NoBatch
        );
    }

    #[test]
    fn streaming_is_a_bijection_for_every_n_below_10_000() {
        for key in [0u64, 0xdead_beef] {
            let mut seen = vec![false; 10_000];
            for n in 0..10_000u64 {
                let f = Feistel::new(n, key ^ n);
                seen[..n as usize].iter_mut().for_each(|s| *s = false);
                for i in 0..n {
                    let x = f.permute(i) as usize;
                    assert!(x < n as usize && !seen[x], "n={n}: {i} -> {x}");
                    seen[x] = true;
                }
            }
        }
    }

    #[test]
    fn padding_duplicates_samples_and_the_eval_sampler_does_not() {
        // 10 samples over 4 ranks: 3 each, 2 samples counted twice.
        let all: Vec<u64> = (0..4)
            .flat_map(|r| {
                DistributedSampler::new(10, 4, r, false, 0, false)
                    .unwrap()
                    .indices()
                    .unwrap()
            })
            .collect();
        assert_eq!(all.len(), 12);
        let eval: Vec<u64> = (0..4)
            .flat_map(|r| {
                EvalSampler::new(10, 4, r)
                    .unwrap()
                    .indices()
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut sorted = eval.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        let counts: Vec<u64> = (0..4)
            .map(|r| EvalSampler::new(10, 4, r).unwrap().count())
            .collect();
        assert_eq!(counts, vec![3, 3, 2, 2]);
    }

    #[test]
    fn batches_resume_from_a_sample_offset() {
        let s = || DistributedSampler::new(103, 3, 1, true, 9, false).unwrap();
        let full: Vec<u64> = BatchSampler::new(s(), 5, false)
            .unwrap()
            .batches()
            .flatten()
            .collect();
        assert_eq!(full, s().indices().unwrap());
        let mut b = BatchSampler::new(s(), 5, false).unwrap();
        b.skip(12);
        let rest: Vec<u64> = b.batches().flatten().collect();
        assert_eq!(rest, full[12..]);
        let mut dropped = BatchSampler::new(s(), 5, true).unwrap();
        assert_eq!(dropped.len(), 35 / 5);
        assert!(dropped.batches().all(|b| b.len() == 5));
        assert_eq!(s().iter_from(30).collect::<Vec<_>>(), full[30..]);
    }

    mod proptests {
        use super::super::*;
        use proptest::prelude::*;

        fn config() -> impl Strategy<Value = (u64, usize, bool, u64, bool, bool)> {
            (
                0u64..2000,
                1usize..9,
                any::<bool>(),
                any::<u64>(),
                any::<bool>(),
                any::<bool>(),
            )
        }

        fn shards(
            n: u64,
            r: usize,
            shuffle: bool,
            seed: u64,
            drop_last: bool,
            streaming: bool,
            epoch: u64,
        ) -> Vec<Vec<u64>> {
            (0..r)
                .map(|k| {
                    let mode = if streaming {
                        Mode::Streaming
                    } else {
                        Mode::Exact
                    };
                    let mut s = DistributedSampler::new(n, r, k, shuffle, seed, drop_last)
                        .unwrap()
                        .with_mode(mode);
                    s.set_epoch(epoch);
                    s.indices().unwrap()
                })
                .collect()
        }

        proptest! {
            #[test]
            fn every_rank_gets_the_same_count((n, r, shuffle, seed, drop_last, streaming) in config()) {
                let sh = shards(n, r, shuffle, seed, drop_last, streaming, 0);
                let want = DistributedSampler::new(n, r, 0, shuffle, seed, drop_last).unwrap().len();
                for s in &sh {
                    prop_assert_eq!(s.len() as u64, want);
                }
            }

            #[test]
            fn coverage_is_exact_or_padded_with_the_leading_indices(
                (n, r, shuffle, seed, drop_last, streaming) in config()
            ) {
                let sh = shards(n, r, shuffle, seed, drop_last, streaming, 1);
                // Reassemble the global order: rank k holds positions k, k+r, ...
                let total = sh[0].len() * r;
                let mut order = vec![0u64; total];
                for (k, s) in sh.iter().enumerate() {
                    for (i, x) in s.iter().enumerate() {
                        order[k + i * r] = *x;
                    }
                }
                if n % r as u64 == 0 || drop_last {
                    let mut seen = order.clone();
                    seen.sort_unstable();
                    seen.dedup();
                    prop_assert_eq!(seen.len(), total, "each index at most once");
                    prop_assert!(order.iter().all(|x| *x < n));
                    if n % r as u64 == 0 {
                        prop_assert_eq!(total as u64, n, "everything covered");
                    }
                } else {
                    // The first n entries are a permutation; the rest repeat
                    // its leading entries.
                    let n = n as usize;
                    let mut head = order[..n].to_vec();
                    head.sort_unstable();
                    prop_assert_eq!(head, (0..n as u64).collect::<Vec<_>>());
                    for j in n..total {
                        prop_assert_eq!(order[j], order[j % n]);
                    }
                }
            }

            #[test]
            fn order_is_deterministic_per_seed_and_epoch(
                n in 50u64..2000, r in 1usize..5, seed in any::<u64>(), streaming in any::<bool>()
            ) {
                let a = shards(n, r, true, seed, false, streaming, 3);
                prop_assert_eq!(&a, &shards(n, r, true, seed, false, streaming, 3));
                prop_assert_ne!(a, shards(n, r, true, seed, false, streaming, 4), "another epoch, another order");
            }

            #[test]
            fn resuming_mid_epoch_matches_random_access(
                (n, r, shuffle, seed, drop_last, streaming) in config(), start in 0u64..3000
            ) {
                let mode = if streaming { Mode::Streaming } else { Mode::Exact };
                let mut s = DistributedSampler::new(n, r, r - 1, shuffle, seed, drop_last).unwrap().with_mode(mode);
                let all = s.indices().unwrap();
                let from = (start as usize).min(all.len());
                prop_assert_eq!(s.iter_from(start).collect::<Vec<_>>(), all[from..].to_vec());
            }

            #[test]
            fn eval_sharding_covers_everything_once(n in 0u64..3000, r in 1usize..9) {
                let mut all: Vec<u64> = (0..r).flat_map(|k| EvalSampler::new(n, r, k).unwrap().indices().collect::<Vec<_>>()).collect();
                let counts: Vec<u64> = (0..r).map(|k| EvalSampler::new(n, r, k).unwrap().count()).collect();
                prop_assert!(counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1);
                all.sort_unstable();
                prop_assert_eq!(all, (0..n).collect::<Vec<_>>());
            }
        }
    }
}
