//! A keyed pseudorandom permutation of `0..n` in O(1) memory: an
//! alternating Feistel network on `0..2^bits` (the smallest power of two at
//! least `n`, so the domain is under `2n`), with cycle-walking back into
//! range. The two halves may differ by one bit: each round maps
//! `(l: a bits, r: b bits)` to `(r, l ^ F(r))`, swapping the widths, and an
//! even number of rounds restores them. `F` is one multiplicative hash
//! (xor the round key, multiply, keep the top bits). Expected walk: under 2.

/// A permutation of `0..n` keyed by a 64-bit key.
#[derive(Clone, Copy, Debug)]
pub struct Feistel {
    n: u64,
    /// Width of the left part at the start of a round pair.
    a: u32,
    /// Width of the right part at the start of a round pair.
    b: u32,
    keys: [u64; ROUNDS],
}

const ROUNDS: usize = 4;

fn mix(mut z: u64) -> u64 {
    // splitmix64's finaliser: derives independent round keys.
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `F`: the top `out` bits of `(r ^ k) * golden`, `out` in 1..=32.
#[inline(always)]
fn f(r: u64, k: u64, out: u32) -> u64 {
    (r ^ k).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - out)
}

impl Feistel {
    /// The permutation of `0..n` for `key`.
    pub fn new(n: u64, key: u64) -> Self {
        let bits = (64 - n.saturating_sub(1).leading_zeros()).max(2);
        let b = bits / 2;
        let a = bits - b;
        let mut keys = [0u64; ROUNDS];
        let mut k = key;
        for slot in &mut keys {
            k = mix(k.wrapping_add(0x9e37_79b9_7f4a_7c15));
            *slot = k;
        }
        Feistel { n, a, b, keys }
    }

    #[inline]
    fn round(&self, x: u64) -> u64 {
        let (mut wl, mut wr) = (self.a, self.b);
        let (mut l, mut r) = (x >> wr, x & ((1u64 << wr) - 1));
        for k in self.keys {
            // (l: wl bits, r: wr bits) -> (r: wr bits, l ^ F(r): wl bits)
            let nl = r;
            let nr = l ^ f(r, k, wl);
            (l, r, wl, wr) = (nl, nr, wr, wl);
        }
        (l << wr) | r
    }

    /// The image of `i` (< n).
    #[inline]
    pub fn permute(&self, i: u64) -> u64 {
        debug_assert!(i < self.n);
        let mut x = self.round(i);
        // The network permutes 0..2^(a+b) < 2n; walk until back in 0..n.
        while x >= self.n {
            x = self.round(x);
        }
        x
    }
}
