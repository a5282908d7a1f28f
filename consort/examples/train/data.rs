//! The UCI handwritten digits (1,797 8×8 images, embedded from
//! `consort/data/digits.csv.gz`) and the fixed train/test split.

use std::io::Read;

const DIGITS_GZ: &[u8] = include_bytes!("../../data/digits.csv.gz");

/// Samples in the training split (divisible by 1, 2, 4 and 8, so that
/// DistributedSampler pads nothing at those world sizes and the global
/// batches are the same samples whatever the world size).
pub(crate) const TRAIN: usize = 1440;

/// One image: 64 pixels scaled to [0, 1], and its label.
#[derive(Clone, Debug)]
pub(crate) struct Sample {
    pub(crate) x: [f32; 64],
    pub(crate) y: usize,
}

/// The dataset, split: `train` then `test`.
pub(crate) struct Digits {
    pub(crate) train: Vec<Sample>,
    pub(crate) test: Vec<Sample>,
}

/// Decompresses and parses the embedded CSV, then splits it with a fixed
/// shuffle (seed 1797), the same on every rank and every run.
pub(crate) fn load() -> Result<Digits, String> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(DIGITS_GZ)
        .read_to_string(&mut text)
        .map_err(|e| format!("the embedded digits.csv.gz does not decompress: {e}"))?;
    let mut all = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let vals: Vec<u32> = line
            .split(',')
            .map(|v| v.trim().parse::<u32>())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("digits.csv line {}: {e}", n + 1))?;
        if vals.len() != 65 || vals[64] > 9 || vals[..64].iter().any(|&p| p > 16) {
            return Err(format!(
                "digits.csv line {}: expected 64 pixels in 0..=16 and a label in 0..=9",
                n + 1
            ));
        }
        let mut x = [0f32; 64];
        for (d, &p) in x.iter_mut().zip(&vals[..64]) {
            *d = p as f32 / 16.0;
        }
        all.push(Sample {
            x,
            y: vals[64] as usize,
        });
    }
    if all.len() <= TRAIN {
        return Err(format!("digits.csv has {} rows; expected 1797", all.len()));
    }
    // Fisher-Yates with a fixed xorshift stream.
    let mut s = 1797u64;
    for i in (1..all.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        all.swap(i, (s % (i as u64 + 1)) as usize);
    }
    let test = all.split_off(TRAIN);
    Ok(Digits { train: all, test })
}
