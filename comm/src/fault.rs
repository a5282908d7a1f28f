//! The fault plan: what a test breaks, and when, written once for the
//! simulator and for the faulty link that wraps every real transport
//! (consort-mesh's `MeshOptions::faults`).
//!
//! This module owns the vocabulary (turmoil's: crash, partition, heal,
//! hold, release, plus drop, delay, duplicate and corrupt) and the matching
//! of messages against it ([`FaultPlan::on_send`]). Faults trigger on time
//! (virtual in the simulator, since the mesh was built on a real one) or
//! message counts and on a seeded RNG, so a simulated scenario replays
//! identically from its seed.

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

    /// Whether a message from `from` to `to` is on this filter's link.
    pub fn matches_link(&self, from: usize, to: usize) -> bool {
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
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value, zero included).
    pub fn new(seed: u64) -> Self {
        // splitmix64 of the seed: never zero, well mixed.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// What the plan does to one message.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Verdict {
    /// The message vanishes.
    pub dropped: bool,
    /// It arrives twice.
    pub duplicated: bool,
    /// One of its bytes is flipped.
    pub corrupted: bool,
    /// It leaves this much later.
    pub delay: Duration,
    /// It is held until this time (since the start), if later than it
    /// would arrive.
    pub held_until: Option<Duration>,
    /// The sender crashes right after sending it.
    pub crash_after: bool,
}

/// A fault list with the per-fault message counts that `nth` filters need.
#[derive(Clone, Debug, Default)]
pub struct FaultPlan {
    faults: Vec<(Fault, u64)>,
}

impl FaultPlan {
    /// The plan of `faults`.
    pub fn new(faults: impl IntoIterator<Item = Fault>) -> Self {
        FaultPlan {
            faults: faults.into_iter().map(|f| (f, 0)).collect(),
        }
    }

    /// The faults.
    pub fn faults(&self) -> impl Iterator<Item = &Fault> {
        self.faults.iter().map(|(f, _)| f)
    }

    /// When rank `rank` crashes, if the plan says so.
    pub fn crash_of(&self, rank: usize) -> Option<Trigger> {
        self.faults().find_map(|f| match f {
            Fault::Crash { rank: r, at } if *r == rank => Some(*at),
            _ => None,
        })
    }

    /// The verdict on a message from `from` to `to`, sent at `now` (since
    /// the start) as the sender's `sent`-th message (1-based); counts it
    /// against every `nth` filter on its link.
    pub fn on_send(
        &mut self,
        rng: &mut Rng,
        (from, to): (usize, usize),
        now: Duration,
        sent: u64,
    ) -> Verdict {
        let mut v = Verdict::default();
        for (fault, seen) in &mut self.faults {
            let filter = match fault {
                Fault::Drop(f)
                | Fault::Duplicate(f)
                | Fault::Corrupt(f)
                | Fault::Delay { filter: f, .. } => Some(*f),
                _ => None,
            };
            if let Some(f) = filter {
                if !f.matches_link(from, to) {
                    continue;
                }
                let nth = *seen;
                *seen += 1;
                if f.nth.is_some_and(|n| n != nth) {
                    continue;
                }
                if let Some(p) = f.probability
                    && rng.unit() >= p
                {
                    continue;
                }
                match fault {
                    Fault::Drop(_) => v.dropped = true,
                    Fault::Duplicate(_) => v.duplicated = true,
                    Fault::Corrupt(_) => v.corrupted = true,
                    Fault::Delay { by, .. } => v.delay += *by,
                    _ => {}
                }
                continue;
            }
            match fault {
                Fault::Partition {
                    a,
                    b,
                    from: start,
                    heal_at,
                } => {
                    let cut = (a.contains(&from) && b.contains(&to))
                        || (b.contains(&from) && a.contains(&to));
                    if cut && now >= *start && heal_at.is_none_or(|h| now < h) {
                        v.dropped = true;
                    }
                }
                Fault::Hold {
                    from: f,
                    to: t,
                    at,
                    release_at,
                } if *f == from && *t == to && now >= *at && now < *release_at => {
                    v.held_until = Some(v.held_until.map_or(*release_at, |h| h.max(*release_at)));
                }
                Fault::Crash {
                    rank,
                    at: Trigger::AfterMessages(k),
                } if *rank == from && *k == sent => v.crash_after = true,
                _ => {}
            }
        }
        v
    }
}
