//! consort-sampler: the distributed sampler (to be built).
//!
//! It will own `DistributedSampler`, matching PyTorch bit for bit
//! (MT19937 `randperm`, padding and `drop_last`), and a streaming sampler
//! for datasets too large for an O(N) permutation. It depends on nothing
//! else in consort.
