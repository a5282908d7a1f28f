//! A tanh MLP split into pipeline stages with hand-written backward (input
//! and weight halves apart), its one-process reference, and a helper that
//! runs one task per simulated rank.

#![allow(dead_code, unreachable_pub)]

use std::{collections::HashMap, future::Future, sync::Arc};

use consort_comm::{ProcessGroup, ReduceOp};
use consort_pipeline::{Stage, Tensor, runtime::StageError};
use consort_sim::{SimConfig, SimWorld};

/// One layer: `w` is `out × in`, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer {
    pub w: Vec<f64>,
    pub b: Vec<f64>,
    pub i: usize,
    pub o: usize,
}

/// Layers with deterministic values from `seed`.
pub fn layers(dims: &[usize], seed: u64) -> Vec<Layer> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 2001) as f64 / 1000.0 - 1.0
    };
    dims.windows(2)
        .map(|d| Layer {
            w: (0..d[0] * d[1]).map(|_| next() * 0.5).collect(),
            b: (0..d[1]).map(|_| next() * 0.1).collect(),
            i: d[0],
            o: d[1],
        })
        .collect()
}

/// Per layer: its input, and its output (or, once the input gradient is
/// done, its dz).
type PerLayer = Vec<(Vec<f64>, Vec<f64>)>;

/// How a stage's gradients are reduced across data-parallel replicas.
#[derive(Clone)]
pub enum Dp {
    /// One replica.
    None,
    /// DDP: the whole gradient all-reduced (mean) over this group.
    Ddp(ProcessGroup),
    /// FSDP: parameters sharded over this group; gathered before the
    /// stage's first action, gradients reduce-scattered (mean).
    Fsdp(ProcessGroup),
}

/// One pipeline stage of the MLP.
pub struct MlpStage {
    pub layers: Vec<Layer>,
    pub grads: Vec<Layer>,
    pub last: bool,
    dp: Dp,
    /// Per microbatch, each layer's input and output (tanh).
    saved: HashMap<usize, PerLayer>,
    /// Per microbatch whose weights are owed: each layer's input and dz.
    owed: HashMap<usize, PerLayer>,
    /// Last stage: per microbatch, d loss / d output.
    loss_grad: HashMap<usize, Vec<f64>>,
    /// FSDP: this rank's shard of the flat parameters, and its gradient.
    pub shard: Vec<f64>,
    pub shard_grad: Vec<f64>,
}

fn flat(ls: &[Layer]) -> Vec<f64> {
    ls.iter()
        .flat_map(|l| l.w.iter().chain(&l.b).copied())
        .collect()
}

fn unflat(ls: &mut [Layer], v: &[f64]) {
    let mut at = 0;
    for l in ls {
        let (nw, nb) = (l.w.len(), l.b.len());
        l.w.copy_from_slice(&v[at..at + nw]);
        l.b.copy_from_slice(&v[at + nw..at + nw + nb]);
        at += nw + nb;
    }
}

fn zeroed(ls: &[Layer]) -> Vec<Layer> {
    ls.iter()
        .map(|l| Layer {
            w: vec![0.0; l.w.len()],
            b: vec![0.0; l.b.len()],
            ..*l
        })
        .collect()
}

impl MlpStage {
    pub fn new(layers: Vec<Layer>, last: bool, dp: Dp) -> Self {
        let mut s = MlpStage {
            grads: zeroed(&layers),
            layers,
            last,
            dp,
            saved: HashMap::new(),
            owed: HashMap::new(),
            loss_grad: HashMap::new(),
            shard: Vec::new(),
            shard_grad: Vec::new(),
        };
        if let Dp::Fsdp(g) = &s.dp {
            let (n, w, r) = (flat(&s.layers).len(), g.world_size(), g.rank());
            let per = n.div_ceil(w);
            let mut full = flat(&s.layers);
            full.resize(per * w, 0.0);
            s.shard = full[r * per..(r + 1) * per].to_vec();
            // Resharded: the stage holds its shard only until unshard.
            for l in &mut s.layers {
                l.w.fill(f64::NAN);
                l.b.fill(f64::NAN);
            }
        }
        s
    }

    /// One SGD step on what this rank holds, gradients zeroed after.
    pub fn sgd(&mut self, lr: f64) {
        if let Dp::Fsdp(_) = self.dp {
            for (p, g) in self.shard.iter_mut().zip(&self.shard_grad) {
                *p -= lr * g;
            }
        } else {
            for (l, g) in self.layers.iter_mut().zip(&self.grads) {
                for (p, d) in l.w.iter_mut().zip(&g.w).chain(l.b.iter_mut().zip(&g.b)) {
                    *p -= lr * d;
                }
            }
        }
        self.grads = zeroed(&self.layers);
    }

    /// Microbatches whose activations this stage keeps.
    pub fn held(&self) -> usize {
        self.saved.len() + self.owed.len()
    }

    /// The full parameters (gathered for FSDP by the caller).
    pub fn params(&self) -> Vec<f64> {
        flat(&self.layers)
    }

    fn forward_rows(&mut self, mb: usize, x: &[f64], rows: usize) -> Vec<f64> {
        let mut x = x.to_vec();
        let mut saved = Vec::new();
        for l in &self.layers {
            let mut y = vec![0.0; rows * l.o];
            for r in 0..rows {
                for o in 0..l.o {
                    let z: f64 = (0..l.i).map(|k| l.w[o * l.i + k] * x[r * l.i + k]).sum();
                    y[r * l.o + o] = (z + l.b[o]).tanh();
                }
            }
            saved.push((x, y.clone()));
            x = y;
        }
        self.saved.insert(mb, saved);
        x
    }

    /// Input gradient through every layer; each layer's (input, dz) owed.
    fn backward_rows(&mut self, mb: usize, mut dy: Vec<f64>) -> Result<Vec<f64>, StageError> {
        let saved = self.saved.remove(&mb).ok_or("backward before forward")?;
        let mut owed = Vec::new();
        for (l, (x, y)) in self.layers.iter().zip(saved).rev() {
            let rows = y.len() / l.o;
            let dz: Vec<f64> = dy.iter().zip(&y).map(|(d, y)| d * (1.0 - y * y)).collect();
            let mut dx = vec![0.0; rows * l.i];
            for r in 0..rows {
                for o in 0..l.o {
                    for k in 0..l.i {
                        dx[r * l.i + k] += dz[r * l.o + o] * l.w[o * l.i + k];
                    }
                }
            }
            owed.push((x, dz));
            dy = dx;
        }
        owed.reverse();
        self.owed.insert(mb, owed);
        Ok(dy)
    }

    fn weights(&mut self, mb: usize) -> Result<(), StageError> {
        let owed = self
            .owed
            .remove(&mb)
            .ok_or("weights before input gradients")?;
        for ((l, g), (x, dz)) in self.layers.iter().zip(&mut self.grads).zip(owed) {
            let rows = dz.len() / l.o;
            for r in 0..rows {
                for o in 0..l.o {
                    g.b[o] += dz[r * l.o + o];
                    for k in 0..l.i {
                        g.w[o * l.i + k] += dz[r * l.o + o] * x[r * l.i + k];
                    }
                }
            }
        }
        Ok(())
    }
}

fn one(t: Vec<Tensor<f64>>) -> Result<Tensor<f64>, StageError> {
    let mut it = t.into_iter();
    match (it.next(), it.next()) {
        (Some(t), None) => Ok(t),
        _ => Err("expected exactly one tensor".into()),
    }
}

impl Stage<f64> for MlpStage {
    fn forward(
        &mut self,
        mb: usize,
        inputs: Vec<Tensor<f64>>,
    ) -> Result<Vec<Tensor<f64>>, StageError> {
        let x = one(inputs)?;
        let rows = x.shape[0];
        if x.shape.get(1) != Some(&self.layers[0].i) {
            return Err(format!("input of shape {:?}", x.shape).into());
        }
        let y = self.forward_rows(mb, &x.data, rows);
        let o = self.layers.last().map_or(0, |l| l.o);
        Ok(vec![Tensor::new(vec![rows, o], y).ok_or("shape")?])
    }

    fn loss(
        &mut self,
        mb: usize,
        outputs: &[Tensor<f64>],
        target: &Tensor<f64>,
    ) -> Result<f64, StageError> {
        let y = &outputs[0];
        if y.shape != target.shape {
            return Err(format!(
                "target of shape {:?} for output {:?}",
                target.shape, y.shape
            )
            .into());
        }
        let rows = y.shape[0].max(1) as f64;
        let diff: Vec<f64> = y
            .data
            .iter()
            .zip(&target.data)
            .map(|(a, b)| a - b)
            .collect();
        let loss = diff.iter().map(|d| d * d).sum::<f64>() / (2.0 * rows);
        self.loss_grad
            .insert(mb, diff.iter().map(|d| d / rows).collect());
        Ok(loss)
    }

    fn backward(
        &mut self,
        mb: usize,
        grads: Option<Vec<Tensor<f64>>>,
    ) -> Result<Vec<Tensor<f64>>, StageError> {
        let dx = self.backward_input(mb, grads)?;
        self.weights(mb)?;
        Ok(dx)
    }

    fn backward_input(
        &mut self,
        mb: usize,
        grads: Option<Vec<Tensor<f64>>>,
    ) -> Result<Vec<Tensor<f64>>, StageError> {
        let dy = match grads {
            Some(g) => one(g)?.data,
            None if self.last => self.loss_grad.remove(&mb).ok_or("no loss")?,
            None => return Err("no output gradients".into()),
        };
        let dx = self.backward_rows(mb, dy)?;
        let i = self.layers[0].i;
        Ok(vec![Tensor::new(vec![dx.len() / i, i], dx).ok_or("shape")?])
    }

    fn backward_weight(&mut self, mb: usize) -> Result<(), StageError> {
        self.weights(mb)
    }

    async fn unshard(&mut self) -> Result<(), StageError> {
        if let Dp::Fsdp(g) = &self.dp {
            let full = g.all_gather_vec(&self.shard).await?;
            let n = flat(&self.layers).len();
            unflat(&mut self.layers, &full[..n]);
        }
        Ok(())
    }

    async fn reduce_grads(&mut self, scale: f64) -> Result<(), StageError> {
        for g in &mut self.grads {
            g.w.iter_mut()
                .chain(g.b.iter_mut())
                .for_each(|v| *v *= scale);
        }
        match &self.dp {
            Dp::None => {}
            Dp::Ddp(g) => {
                let mut v = flat(&self.grads);
                g.all_reduce(&mut v, ReduceOp::Avg).await?;
                unflat(&mut self.grads, &v);
            }
            Dp::Fsdp(g) => {
                let mut v = flat(&self.grads);
                let per = v.len().div_ceil(g.world_size());
                v.resize(per * g.world_size(), 0.0);
                self.shard_grad = vec![0.0; per];
                g.reduce_scatter(&mut self.shard_grad, &v, ReduceOp::Avg)
                    .await?;
            }
        }
        Ok(())
    }

    async fn reshard(&mut self) -> Result<(), StageError> {
        if let Dp::Fsdp(_) = self.dp {
            for l in &mut self.layers {
                l.w.fill(f64::NAN);
                l.b.fill(f64::NAN);
            }
        }
        Ok(())
    }
}

/// Runs `f(rank)` on every rank of a simulated world of `cfg`, on one
/// current-thread runtime; returns each rank's output in rank order.
pub fn run_sim<T, F, Fut>(cfg: SimConfig, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Arc<consort_sim::SimRank>) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let world = SimWorld::new(cfg).expect("sim world");
    world.run_each(|r| f(Arc::new(r))).expect("tokio runtime")
}
