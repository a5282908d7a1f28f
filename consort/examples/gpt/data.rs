//! The corpus, generated: lines of sums (`17+25=42`), one character a
//! token. A model that learns them must learn the digits' grammar and,
//! with enough training, to add; the loss falls in the first hundred
//! steps on a CPU.

/// The characters the model reads and writes.
pub(crate) const VOCAB: &[u8] = b"0123456789+=\n";

/// `lines` sums of two numbers below 100, from a fixed seed: the same on
/// every rank and every run.
pub(crate) fn corpus(lines: usize) -> Vec<u8> {
    let mut s: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        s = s
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (s >> 33) % 100
    };
    let mut out = Vec::new();
    for _ in 0..lines {
        let (a, b) = (next(), next());
        out.extend_from_slice(format!("{a}+{b}={}\n", a + b).as_bytes());
    }
    out.iter()
        .map(|c| {
            VOCAB
                .iter()
                .position(|v| v == c)
                .expect("in the vocabulary") as u8
        })
        .collect()
}

/// The windows the sampler draws from: window `i` is tokens
/// `i*stride .. i*stride + context + 1` (inputs and, shifted by one,
/// targets).
pub(crate) fn windows(corpus_len: usize, context: usize, stride: usize) -> usize {
    corpus_len.saturating_sub(context + 1) / stride
}

/// Inputs and targets of the windows `picks`, flattened row-major.
pub(crate) fn batch(
    corpus: &[u8],
    picks: &[u64],
    context: usize,
    stride: usize,
) -> (Vec<i64>, Vec<i64>) {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for &p in picks {
        let at = p as usize * stride;
        let w = &corpus[at..at + context + 1];
        x.extend(w[..context].iter().map(|&t| i64::from(t)));
        y.extend(w[1..].iter().map(|&t| i64::from(t)));
    }
    (x, y)
}

/// FNV-1a (64-bit) of the token ids: the summary's fingerprint of the
/// corpus, which `torch_ddp.py` computes the same way.
pub(crate) fn fnv1a(tokens: &[u8]) -> u64 {
    tokens.iter().fold(0xcbf2_9ce4_8422_2325, |h, &t| {
        (h ^ u64::from(t)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
