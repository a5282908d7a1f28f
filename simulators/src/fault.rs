//! The fault plan: what the simulator breaks, and when.
//!
//! This module owns the vocabulary (turmoil's: crash, partition, heal,
//! hold, release, plus drop, delay, duplicate and corrupt) and the matching
//! of messages against it. Faults trigger on virtual time or message counts
//! and on a seeded RNG, so a scenario replays identically from its seed.

use std::time::Duration;

/// When a crash happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// At this virtual time since the world started.
    At(Duration),
    /// Right after the rank has sent this many messages.
    AfterMessages(u64),
}

/// Which messages a fault applies to. Every `None` field matches anything.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MsgFilter {
    /// Sender.
    pub from: Option<usize>,
    /// Receiver.
    pub to: Option<usize>,
    /// Only the `nth` matching message (0-based).
    pub nth: Option<u64>,
    /// Each matching message with this probability (seeded).
    pub probability: Option<f64>,
}

impl MsgFilter {
    /// Messages from `from` to `to`.
    pub fn link(from: usize, to: usize) -> Self {
        MsgFilter {
            from: Some(from),
            to: Some(to),
            ..Default::default()
        }
    }

    /// Only the `nth` (0-based) of the messages this filter matches.
    #[must_use]
    pub fn nth(mut self, nth: u64) -> Self {
        self.nth = Some(nth);
        self
    }

    /// Each matching message with probability `p`.
    #[must_use]
    pub fn with_probability(mut self, p: f64) -> Self {
        self.probability = Some(p);
        self
    }

    pub(crate) fn matches_link(&self, from: usize, to: usize) -> bool {
        self.from.is_none_or(|f| f == from) && self.to.is_none_or(|t| t == to)
    }
}

/// One fault in the plan.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Fault {
    /// The rank's process dies: its handle fails, and every survivor sees
    /// `PeerLost` (the simulated connection reset).
    Crash {
        /// The rank.
        rank: usize,
        /// When.
        at: Trigger,
    },
    /// Matching messages vanish (receivers time out).
    Drop(MsgFilter),
    /// Matching messages arrive later by `by`.
    Delay {
        /// Which.
        filter: MsgFilter,
        /// Extra virtual latency.
        by: Duration,
    },
    /// Matching messages arrive twice (the receiver detects the duplicate:
    /// `Protocol`).
    Duplicate(MsgFilter),
    /// Matching messages get one payload byte flipped (the receiver's link
    /// checksum detects it: `Protocol`).
    Corrupt(MsgFilter),
    /// Messages between `a` and `b` are dropped from `from` until `heal_at`
    /// (forever when `None`).
    Partition {
        /// One side.
        a: Vec<usize>,
        /// The other side.
        b: Vec<usize>,
        /// Virtual time the cut starts.
        from: Duration,
        /// Virtual time the cut heals.
        heal_at: Option<Duration>,
    },
    /// Messages from `from` to `to` sent in `[at, release_at)` are held and
    /// delivered at `release_at`.
    Hold {
        /// Sender.
        from: usize,
        /// Receiver.
        to: usize,
        /// Virtual time holding starts.
        at: Duration,
        /// Virtual time the held messages are released.
        release_at: Duration,
    },
}

/// A small, seedable PRNG (xorshift64*), so faults replay from the seed.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        // splitmix64 of the seed: never zero, well mixed.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}
