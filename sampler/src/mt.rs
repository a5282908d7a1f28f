//! MT19937 and `torch.randperm`'s CPU algorithm, bit for bit.

/// The 32-bit Mersenne Twister, seeded as PyTorch's CPU generator does
/// (`init_genrand` with the low 32 bits of the 64-bit seed).
#[derive(Clone, Debug)]
pub struct Mt19937 {
    state: [u32; 624],
    index: usize,
}

impl Mt19937 {
    /// A generator as `torch.Generator().manual_seed(seed)` makes it.
    pub fn new(seed: u64) -> Self {
        let mut state = [0u32; 624];
        state[0] = seed as u32;
        for i in 1..624 {
            let prev = state[i - 1];
            state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        Mt19937 { state, index: 624 }
    }

    fn twist(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        for i in 0..624 {
            let y = (self.state[i] & UPPER) | (self.state[(i + 1) % 624] & LOWER);
            let mut v = self.state[(i + 397) % 624] ^ (y >> 1);
            if y & 1 != 0 {
                v ^= 0x9908_b0df;
            }
            self.state[i] = v;
        }
        self.index = 0;
    }

    /// One 32-bit draw (`generator->random()`), tempered.
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= 624 {
            self.twist();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// One 64-bit draw (`generator->random64()`): the first draw is the
    /// high half.
    pub fn next_u64(&mut self) -> u64 {
        let hi = u64::from(self.next_u32());
        let lo = u64::from(self.next_u32());
        (hi << 32) | lo
    }
}

/// Below this `n`, randperm draws 32-bit numbers and swaps forward; from
/// it on, it runs the inside-out shuffle on 64-bit draws (as ATen does).
pub const SMALL_N_LIMIT: u64 = u32::MAX as u64 / 20;

/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))` on
/// CPU, bit for bit.
pub fn randperm(n: usize, seed: u64) -> Vec<u64> {
    let mut g = Mt19937::new(seed);
    if (n as u64) < SMALL_N_LIMIT {
        shuffle_forward(n, &mut g)
    } else {
        shuffle_inside_out(n, &mut g)
    }
}

/// ATen's small-n path: identity, then swap `i` with `i + random() % (n-i)`.
fn shuffle_forward(n: usize, g: &mut Mt19937) -> Vec<u64> {
    let mut r: Vec<u64> = (0..n as u64).collect();
    for i in 0..n.saturating_sub(1) {
        let z = u64::from(g.next_u32()) % (n - i) as u64;
        r.swap(i, i + z as usize);
    }
    r
}

/// ATen's large-n path: inside-out Fisher-Yates on 64-bit draws.
fn shuffle_inside_out(n: usize, g: &mut Mt19937) -> Vec<u64> {
    let mut r = vec![0u64; n];
    for i in 0..n {
        let z = (g.next_u64() % (i as u64 + 1)) as usize;
        r[i] = r[z];
        r[z] = i as u64;
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mt19937_reference_outputs() {
        // The reference implementation's first outputs for seed 5489.
        let mut g = Mt19937::new(5489);
        let first: Vec<u32> = (0..3).map(|_| g.next_u32()).collect();
        assert_eq!(first, vec![3_499_211_612, 581_869_302, 3_890_346_734]);
        // Only the low 32 bits of the seed matter, as in torch.
        assert_eq!(
            Mt19937::new(1 << 32 | 7).next_u32(),
            Mt19937::new(7).next_u32()
        );
    }

    #[test]
    fn both_paths_are_permutations() {
        for n in [0usize, 1, 2, 1000] {
            for r in [
                shuffle_forward(n, &mut Mt19937::new(3)),
                shuffle_inside_out(n, &mut Mt19937::new(3)),
            ] {
                let mut s = r.clone();
                s.sort_unstable();
                assert_eq!(s, (0..n as u64).collect::<Vec<_>>());
            }
        }
    }
}
