//! The cores a rank may run on, as its card publishes them, and how many
//! cores the ranks of one host have between them.
//!
//! A rank's own count (`available_parallelism`) is not the host's: a
//! launcher that pins every rank to a core of its own leaves each rank one
//! core on a host of many. So a card carries the rank's affinity mask, and
//! the host's cores are the union of its ranks' masks, capped by a cgroup
//! quota where one applies (a rank allowed fewer cores than its mask holds).

use std::fmt;

/// One rank's cores: its affinity mask and, under a cgroup quota, the
/// cores the quota allows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Cpus {
    /// Bit `i` of word `i / 64`: the rank may run on CPU `i`.
    mask: Vec<u64>,
    /// Fewer cores than the mask holds, where a quota allows only so many.
    quota: Option<usize>,
}

impl Cpus {
    /// This process's cores.
    pub(crate) fn this_process() -> Cpus {
        let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mask = affinity().unwrap_or_else(|| {
            // Unknown affinity: CPUs 0..allowed.
            let mut m = vec![0u64; allowed.div_ceil(64)];
            for i in 0..allowed {
                m[i / 64] |= 1 << (i % 64);
            }
            m
        });
        let c = Cpus { mask, quota: None };
        let n = c.count();
        Cpus {
            quota: (allowed < n).then_some(allowed),
            ..c
        }
    }

    /// A mask of the CPUs in `ids`, with an optional quota (for tests).
    #[cfg(test)]
    pub(crate) fn of(ids: &[usize], quota: Option<usize>) -> Cpus {
        let mut mask = vec![0u64; ids.iter().max().map_or(0, |m| m / 64 + 1)];
        for &i in ids {
            mask[i / 64] |= 1 << (i % 64);
        }
        Cpus { mask, quota }
    }

    fn count(&self) -> usize {
        self.mask.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The cores this rank itself may use: its mask, capped by its quota.
    pub(crate) fn usable(&self) -> usize {
        let n = self.count();
        self.quota.map_or(n, |q| n.min(q)).max(1)
    }

    /// Reads what [`fmt::Display`] wrote: `word,word,... quota|-`.
    pub(crate) fn parse(s: &str) -> Option<Cpus> {
        let (words, quota) = s.split_once(' ')?;
        let mask = words
            .split(',')
            .map(|w| u64::from_str_radix(w, 16).ok())
            .collect::<Option<Vec<u64>>>()?;
        let quota = match quota {
            "-" => None,
            q => Some(q.parse().ok().filter(|&q: &usize| q > 0)?),
        };
        let c = Cpus { mask, quota };
        (c.count() > 0).then_some(c)
    }
}

impl fmt::Display for Cpus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let words: Vec<String> = self.mask.iter().map(|w| format!("{w:x}")).collect();
        match self.quota {
            Some(q) => write!(f, "{} {q}", words.join(",")),
            None => write!(f, "{} -", words.join(",")),
        }
    }
}

/// The cores the ranks `cpus` of one host have between them: the union of
/// their masks, capped by the largest quota if any rank runs under one.
pub(crate) fn host_cores<'a>(cpus: impl Iterator<Item = &'a Cpus>) -> usize {
    let mut union: Vec<u64> = Vec::new();
    let mut quota: Option<usize> = None;
    for c in cpus {
        if union.len() < c.mask.len() {
            union.resize(c.mask.len(), 0);
        }
        for (u, w) in union.iter_mut().zip(&c.mask) {
            *u |= w;
        }
        if let Some(q) = c.quota {
            quota = Some(quota.map_or(q, |x| x.max(q)));
        }
    }
    let n: usize = union.iter().map(|w| w.count_ones() as usize).sum();
    quota.map_or(n, |q| n.min(q)).max(1)
}

/// This thread's affinity mask, or `None` where it cannot be read.
fn affinity() -> Option<Vec<u64>> {
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return None;
    }
    let bits = 8 * std::mem::size_of::<libc::cpu_set_t>();
    let mut mask = vec![0u64; bits / 64];
    for i in 0..bits {
        // SAFETY: `i` is below CPU_SETSIZE.
        if unsafe { libc::CPU_ISSET(i, &set) } {
            mask[i / 64] |= 1 << (i % 64);
        }
    }
    while mask.len() > 1 && mask.last() == Some(&0) {
        mask.pop();
    }
    Some(mask)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_round_trip_and_unite() {
        let me = Cpus::this_process();
        assert_eq!(Cpus::parse(&me.to_string()), Some(me.clone()));
        assert!(me.count() >= 1);
        let q = Cpus::of(&[0, 1, 70], Some(2));
        assert_eq!(Cpus::parse(&q.to_string()), Some(q.clone()));
        for bad in ["", "3", "zz -", "0 -", "3 0", "3 x"] {
            assert_eq!(Cpus::parse(bad), None, "{bad:?}");
        }
        // Four ranks pinned to a core each: four cores between them.
        let pinned: Vec<Cpus> = (0..4).map(|i| Cpus::of(&[i], None)).collect();
        assert_eq!(host_cores(pinned.iter()), 4);
        // Four ranks sharing two cores.
        let shared: Vec<Cpus> = (0..4).map(|_| Cpus::of(&[0, 1], None)).collect();
        assert_eq!(host_cores(shared.iter()), 2);
        // A quota of 2 on a 64-core mask.
        let all: Vec<usize> = (0..64).collect();
        let quota: Vec<Cpus> = (0..4).map(|_| Cpus::of(&all, Some(2))).collect();
        assert_eq!(host_cores(quota.iter()), 2);
    }
}
