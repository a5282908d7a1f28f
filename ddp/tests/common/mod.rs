//! A small MLP with hand-written backward, the reference for DDP's
//! properties, and a helper that runs one task per simulated rank.

#![allow(dead_code, unreachable_pub)]

use std::{
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering::SeqCst},
    },
};

pub mod shard;

use consort_ddp::PlainModel;
use consort_sim::{SimConfig, SimRank, SimWorld};
use proptest::prelude::*;

/// Layer widths `[in, h1, ..., out]`; parameters are `w0, b0, w1, b1, …`
/// (`w_l` is `dims[l+1] × dims[l]`, row-major), ReLU between layers.
#[derive(Clone, Debug)]
pub struct Mlp {
    pub dims: Vec<usize>,
}

impl Mlp {
    pub fn layers(&self) -> usize {
        self.dims.len() - 1
    }

    /// A model with the given parameter values (`values[p]` for param p).
    pub fn model(&self, values: &[Vec<f64>]) -> PlainModel {
        let mut m = PlainModel::new();
        for l in 0..self.layers() {
            let (i, o) = (self.dims[l], self.dims[l + 1]);
            m.add_param(format!("layers.{l}.weight"), vec![o, i], &values[2 * l])
                .unwrap();
            m.add_param(format!("layers.{l}.bias"), vec![o], &values[2 * l + 1])
                .unwrap();
        }
        m
    }

    /// Parameter sizes in order.
    pub fn sizes(&self) -> Vec<usize> {
        (0..self.layers())
            .flat_map(|l| [self.dims[l] * self.dims[l + 1], self.dims[l + 1]])
            .collect()
    }

    /// Gradients of `scale * Σ_samples 0.5‖f(x) − y‖²` for each parameter,
    /// produced layer by layer from the last (the order backward yields
    /// them): calls `ready(param index, gradient)`.
    pub fn backward(
        &self,
        params: &[Vec<f64>],
        xs: &[Vec<f64>],
        ys: &[Vec<f64>],
        scale: f64,
        mut ready: impl FnMut(usize, Vec<f64>),
    ) {
        let l_n = self.layers();
        let mut grads: Vec<Vec<f64>> = self.sizes().iter().map(|&s| vec![0.0; s]).collect();
        for (x, y) in xs.iter().zip(ys) {
            // forward, keeping every layer's input
            let mut acts = vec![x.clone()];
            for l in 0..l_n {
                let (i, o) = (self.dims[l], self.dims[l + 1]);
                let w = &params[2 * l];
                let b = &params[2 * l + 1];
                let a = acts.last().unwrap();
                let mut z: Vec<f64> = (0..o)
                    .map(|r| b[r] + (0..i).map(|c| w[r * i + c] * a[c]).sum::<f64>())
                    .collect();
                if l + 1 < l_n {
                    z.iter_mut().for_each(|v| *v = v.max(0.0));
                }
                acts.push(z);
            }
            let out = acts.last().unwrap();
            let mut delta: Vec<f64> = out.iter().zip(y).map(|(o, t)| (o - t) * scale).collect();
            for l in (0..l_n).rev() {
                let (i, o) = (self.dims[l], self.dims[l + 1]);
                let a = &acts[l];
                for r in 0..o {
                    grads[2 * l + 1][r] += delta[r];
                    for c in 0..i {
                        grads[2 * l][r * i + c] += delta[r] * a[c];
                    }
                }
                if l > 0 {
                    let w = &params[2 * l];
                    delta = (0..i)
                        .map(|c| {
                            let d: f64 = (0..o).map(|r| w[r * i + c] * delta[r]).sum();
                            if acts[l][c] > 0.0 { d } else { 0.0 }
                        })
                        .collect();
                }
            }
        }
        for l in (0..l_n).rev() {
            ready(2 * l + 1, std::mem::take(&mut grads[2 * l + 1]));
            ready(2 * l, std::mem::take(&mut grads[2 * l]));
        }
    }
}

/// Runs `f(rank handle)` for every rank of a simulated world of `n`, each
/// on its own task of one current-thread runtime; results in rank order.
pub fn run_sim<T, F, Fut>(cfg: SimConfig, f: F) -> (Vec<T>, SimWorld)
where
    T: Send + 'static,
    F: Fn(Arc<SimRank>) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let world = SimWorld::new(cfg).expect("sim world");
    let out = world.run_each(|r| f(Arc::new(r))).expect("tokio runtime");
    (out, world)
}

/// One rank's micro-batch: (x, y) samples.
pub type Batch = Vec<(Vec<f64>, Vec<f64>)>;

#[derive(Clone, Debug)]
pub struct Case {
    pub mlp: Mlp,
    pub world: usize,
    pub batch: usize,
    pub micro: usize,
    pub cap: Option<usize>,
    pub view: bool,
    /// Integer-valued data, lr 1 and a loss scaled so that every sum is
    /// exact: results must match bit for bit.
    pub exact: bool,
    /// What the data came from (also seeds the emulated device).
    pub seed: u64,
    pub init: Vec<Vec<f64>>,
    /// `data[step][micro][rank][sample] = (x, y)`
    pub data: Vec<Vec<Vec<Batch>>>,
}

/// Random cases: MLP widths, worlds `1..=max_world`, batches, micro-batches,
/// steps, bucket caps, view mode, exact mode and data.
pub fn case(max_world: usize) -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(1usize..6, 2..4),
        1usize..=max_world,
        1usize..4,
        1usize..4,
        1usize..4,
        prop::option::of(8usize..400),
        any::<bool>(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |(dims, world, batch, micro, steps, cap, view, exact, seed)| {
                make_case(Shape {
                    dims,
                    world,
                    batch,
                    micro,
                    steps,
                    cap,
                    view,
                    exact,
                    seed,
                })
            },
        )
}

/// The dimensions of a [`Case`]; its data come from the seed.
pub struct Shape {
    pub dims: Vec<usize>,
    pub world: usize,
    pub batch: usize,
    pub micro: usize,
    pub steps: usize,
    pub cap: Option<usize>,
    pub view: bool,
    pub exact: bool,
    pub seed: u64,
}

/// The case of `shape`: initial parameters and every rank's data, from a
/// xorshift stream of the seed (small integers in exact mode).
pub fn make_case(shape: Shape) -> Case {
    let Shape {
        dims,
        world,
        batch,
        micro,
        steps,
        cap,
        view,
        exact,
        seed,
    } = shape;
    let mlp = Mlp { dims };
    let mut rng = seed | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        if exact {
            (rng % 5) as f64 - 2.0
        } else {
            (rng % 2001) as f64 / 1000.0 - 1.0
        }
    };
    let steps = if exact { steps.min(2) } else { steps };
    let init = mlp
        .sizes()
        .iter()
        .map(|&s| (0..s).map(|_| next()).collect())
        .collect();
    let (i, o) = (mlp.dims[0], *mlp.dims.last().unwrap());
    let mut sample = || {
        let x = (0..i).map(|_| next()).collect();
        let y = (0..o).map(|_| next()).collect();
        (x, y)
    };
    let data = (0..steps)
        .map(|_| {
            (0..micro)
                .map(|_| {
                    (0..world)
                        .map(|_| (0..batch).map(|_| sample()).collect())
                        .collect()
                })
                .collect()
        })
        .collect();
    Case {
        mlp,
        world,
        batch,
        micro,
        cap,
        view,
        exact,
        seed,
        init,
        data,
    }
}

/// The learning rate: 1 in exact mode.
pub fn lr(c: &Case) -> f64 {
    if c.exact { 1.0 } else { 0.05 }
}

/// One process, the whole global batch of every step.
pub fn reference(c: &Case) -> Vec<Vec<f64>> {
    let mut params = c.init.clone();
    let scale = if c.exact {
        1.0
    } else {
        1.0 / (c.world * c.batch * c.micro) as f64
    };
    for step in &c.data {
        let (xs, ys): (Vec<_>, Vec<_>) = step.iter().flatten().flatten().cloned().unzip();
        let mut grads = vec![Vec::new(); params.len()];
        c.mlp
            .backward(&params, &xs, &ys, scale, |i, g| grads[i] = g);
        for (p, g) in params.iter_mut().zip(grads) {
            for (v, d) in p.iter_mut().zip(g) {
                *v -= lr(c) * d;
            }
        }
    }
    params
}

/// Equal within 1e-9, relative.
pub fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}

/// A backend that counts its calls: made in all, and in flight (made, not
/// yet finished) now and at most.
#[derive(Debug)]
pub struct Counting {
    pub inner: Arc<SimRank>,
    pub made: Arc<AtomicUsize>,
    pub now: Arc<AtomicUsize>,
    pub max: Arc<AtomicUsize>,
}

impl Counting {
    pub fn new(inner: Arc<SimRank>) -> Arc<Self> {
        Arc::new(Counting {
            inner,
            made: Arc::default(),
            now: Arc::default(),
            max: Arc::default(),
        })
    }
}

/// Counts a call out when its work finishes or is dropped.
struct Out(Arc<AtomicUsize>);

impl Drop for Out {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

#[async_trait::async_trait]
impl consort_comm::Backend for Counting {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn default_timeout(&self) -> std::time::Duration {
        self.inner.default_timeout()
    }
    fn submit<'a>(
        &'a self,
        op: consort_comm::Op<'a>,
        opts: &consort_comm::CallOptions,
    ) -> consort_comm::Work<'a> {
        let work = self.inner.submit(op, opts);
        self.made.fetch_add(1, SeqCst);
        let now = self.now.fetch_add(1, SeqCst) + 1;
        self.max.fetch_max(now, SeqCst);
        let out = Out(self.now.clone());
        consort_comm::Work::new(async move {
            let r = work.await;
            drop(out);
            r
        })
    }
}
