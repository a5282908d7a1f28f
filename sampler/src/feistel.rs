//! A keyed pseudorandom permutation of `0..n` in O(1) memory: a balanced
//! Feistel network on the smallest even power of two at least `n`, with
//! cycle-walking back into range. Each of the 4 rounds is one multiplicative
//! hash (xor the round key, multiply, keep the top bits); the domain is
//! under 4n, so the expected walk is under 4 steps and usually 1.

/// A permutation of `0..n` keyed by a 64-bit key.
#[derive(Clone, Copy, Debug)]
pub struct Feistel {
    n: u64,
    half_bits: u32,
    mask: u64,
    keys: [u64; ROUNDS],
}

const ROUNDS: usize = 4;

fn mix(mut z: u64) -> u64 {
    // splitmix64's finaliser: a strong 64-bit mixer.
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Feistel {
    /// The permutation of `0..n` for `key`.
    pub fn new(n: u64, key: u64) -> Self {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        let mut keys = [0u64; ROUNDS];
        let mut k = key;
        for slot in &mut keys {
            k = mix(k.wrapping_add(0x9e37_79b9_7f4a_7c15));
            *slot = k;
        }
        Feistel {
            n,
            half_bits,
            mask: (1u64 << half_bits) - 1,
            keys,
        }
    }

    #[inline]
    fn round(&self, x: u64) -> u64 {
        let (mut l, mut r) = (x >> self.half_bits, x & self.mask);
        let shift = 64 - self.half_bits;
        for k in self.keys {
            // Multiplicative hashing: the product's top bits depend on every
            // bit of `r ^ k`.
            let f = ((r ^ k).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> shift) & self.mask;
            (l, r) = (r, l ^ f);
        }
        (l << self.half_bits) | r
    }

    /// The image of `i` (< n).
    #[inline]
    pub fn permute(&self, i: u64) -> u64 {
        debug_assert!(i < self.n);
        let mut x = self.round(i);
        // The network permutes 0..4^half_bits; walk until back in 0..n.
        while x >= self.n {
            x = self.round(x);
        }
        x
    }
}
