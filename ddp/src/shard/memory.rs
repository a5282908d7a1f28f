//! [`Memory`]: the bytes one rank keeps for training, measured from the
//! buffers a [`Sharded`] holds, and the ZeRO paper's formulas to compare
//! them with.

use super::{Sharded, Strategy};

/// Bytes one rank keeps between steps: parameters, gradients and optimizer
/// state. Transient copies (a gathered unit, a gradient being reduced) are
/// not counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Memory {
    /// Parameter bytes.
    pub params: usize,
    /// Gradient bytes.
    pub grads: usize,
    /// Optimizer-state bytes.
    pub optimizer: usize,
}

impl Memory {
    /// All three.
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optimizer
    }

    /// The formula for a model of `psi` parameter bytes over `n` shards
    /// (the world, or HSDP's shard-group size) with `k` optimizer slots per
    /// element (`strategy` `None`: DDP, nothing sharded). Shards round up.
    pub fn expected(strategy: Option<Strategy>, psi: usize, n: usize, k: usize) -> Memory {
        let shard = psi.div_ceil(n.max(1));
        let Some(s) = strategy else {
            return Memory {
                params: psi,
                grads: psi,
                optimizer: k * psi,
            };
        };
        Memory {
            params: if s.shards_params() { shard } else { psi },
            grads: if s.shards_grads() { shard } else { psi },
            optimizer: k * shard,
        }
    }
}

impl Sharded {
    /// What this rank keeps now (padding included).
    pub fn memory(&self) -> Memory {
        let mut m = Memory::default();
        for fs in &self.flats {
            m.params += fs.params.bytes();
            m.grads += fs.grads.bytes();
            m.optimizer += fs.state.iter().map(|s| s.bytes()).sum::<usize>();
        }
        m
    }
}
