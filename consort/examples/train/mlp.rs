//! The model: a two-layer perceptron (64 → hidden → 10, ReLU, softmax
//! cross-entropy) in plain Rust, with its parameters in a `PlainModel` so
//! that DDP, state dicts and checkpoints work on them directly.

use consort::ddp::{PlainModel, PlainModelError};

use crate::data::Sample;

/// Parameter indices in registration order, as `model.parameters()`.
pub(crate) const W1: usize = 0;
pub(crate) const B1: usize = 1;
pub(crate) const W2: usize = 2;
pub(crate) const B2: usize = 3;

/// A fresh model: weights uniform in ±1/√fan_in (torch's `nn.Linear`
/// default), biases zero, from a seeded stream.
pub(crate) fn init(hidden: usize, seed: u64) -> Result<PlainModel, PlainModelError> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut uniform = move |bound: f32| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * bound
    };
    let w1: Vec<f32> = (0..hidden * 64).map(|_| uniform(1.0 / 8.0)).collect();
    let w2: Vec<f32> = (0..10 * hidden)
        .map(|_| uniform(1.0 / (hidden as f32).sqrt()))
        .collect();
    let mut m = PlainModel::new();
    m.add_param("fc1.weight", vec![hidden, 64], &w1)?;
    m.add_param("fc1.bias", vec![hidden], &vec![0f32; hidden])?;
    m.add_param("fc2.weight", vec![10, hidden], &w2)?;
    m.add_param("fc2.bias", vec![10], &[0f32; 10])?;
    Ok(m)
}

/// The parameters, borrowed.
pub(crate) struct Params<'a> {
    pub(crate) w1: &'a [f32],
    pub(crate) b1: &'a [f32],
    pub(crate) w2: &'a [f32],
    pub(crate) b2: &'a [f32],
}

impl<'a> Params<'a> {
    pub(crate) fn of(m: &'a PlainModel) -> Result<Self, PlainModelError> {
        Ok(Params {
            w1: m.param(W1)?,
            b1: m.param(B1)?,
            w2: m.param(W2)?,
            b2: m.param(B2)?,
        })
    }

    fn hidden(&self) -> usize {
        self.b1.len()
    }

    /// Hidden activations and output logits for one image.
    fn forward(&self, x: &[f32; 64]) -> (Vec<f32>, [f32; 10]) {
        let h: Vec<f32> = (0..self.hidden())
            .map(|j| {
                let row = &self.w1[j * 64..(j + 1) * 64];
                (self.b1[j] + row.iter().zip(x).map(|(w, v)| w * v).sum::<f32>()).max(0.0)
            })
            .collect();
        let mut out = [0f32; 10];
        for (k, o) in out.iter_mut().enumerate() {
            let row = &self.w2[k * h.len()..(k + 1) * h.len()];
            *o = self.b2[k] + row.iter().zip(&h).map(|(w, v)| w * v).sum::<f32>();
        }
        (h, out)
    }

    /// The predicted digit.
    pub(crate) fn predict(&self, x: &[f32; 64]) -> usize {
        let (_, out) = self.forward(x);
        (0..10).fold(0, |best, k| if out[k] > out[best] { k } else { best })
    }
}

/// Gradients of one batch, layer 2's first (the order backward produces
/// them).
pub(crate) struct Grads {
    pub(crate) w2: Vec<f32>,
    pub(crate) b2: Vec<f32>,
    pub(crate) w1: Vec<f32>,
    pub(crate) b1: Vec<f32>,
    /// Summed cross-entropy over the batch.
    pub(crate) loss_sum: f64,
}

/// Softmax cross-entropy's gradients, averaged over `batch` (the loss is
/// the batch mean, as `nn.CrossEntropyLoss()`). `ready_layer2` runs as
/// soon as layer 2's gradients are complete, before layer 1's are
/// computed, so that DDP can start reducing them.
pub(crate) fn backward(
    p: &Params<'_>,
    batch: &[&Sample],
    mut ready_layer2: impl FnMut(&[f32], &[f32]),
) -> Grads {
    let hidden = p.hidden();
    let n = batch.len().max(1) as f32;
    let mut g = Grads {
        w2: vec![0.0; 10 * hidden],
        b2: vec![0.0; 10],
        w1: vec![0.0; hidden * 64],
        b1: vec![0.0; hidden],
        loss_sum: 0.0,
    };
    let mut cache = Vec::with_capacity(batch.len());
    for s in batch {
        let (h, out) = p.forward(&s.x);
        let max = out.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = out.iter().map(|o| (o - max).exp()).collect();
        let z: f32 = exps.iter().sum();
        g.loss_sum += f64::from(z.ln() + max - out[s.y]);
        let mut d_out = [0f32; 10];
        for k in 0..10 {
            d_out[k] = (exps[k] / z - if k == s.y { 1.0 } else { 0.0 }) / n;
            g.b2[k] += d_out[k];
            let row = &mut g.w2[k * hidden..(k + 1) * hidden];
            for (w, hj) in row.iter_mut().zip(&h) {
                *w += d_out[k] * hj;
            }
        }
        cache.push((h, d_out));
    }
    ready_layer2(&g.w2, &g.b2);
    for (s, (h, d_out)) in batch.iter().zip(&cache) {
        for (j, &hj) in h.iter().enumerate() {
            if hj <= 0.0 {
                continue;
            }
            let d: f32 = (0..10).map(|k| p.w2[k * hidden + j] * d_out[k]).sum();
            g.b1[j] += d;
            for (i, x) in s.x.iter().enumerate() {
                g.w1[j * 64 + i] += d * x;
            }
        }
    }
    g
}
