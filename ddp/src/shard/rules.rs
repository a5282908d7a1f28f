//! torch's update rules, as arithmetic on slices: [`Sgd`] and [`AdamW`]
//! with their hyperparameters, shared by the host step ([`super::optim`])
//! and the device kernels' contract ([`super::kernels`]).

/// The float types the optimizers compute in.
pub(crate) trait Real:
    Copy + std::ops::Mul<Output = Self> + std::ops::Add<Output = Self>
{
    fn of(v: f64) -> Self;
    fn sub(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
    fn sqrt(self) -> Self;
}

impl Real for f32 {
    fn of(v: f64) -> Self {
        v as f32
    }
    fn sub(self, o: Self) -> Self {
        self - o
    }
    fn div(self, o: Self) -> Self {
        self / o
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
}

impl Real for f64 {
    fn of(v: f64) -> Self {
        v
    }
    fn sub(self, o: Self) -> Self {
        self - o
    }
    fn div(self, o: Self) -> Self {
        self / o
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
}

/// `torch.optim.SGD`: `p -= lr * d`, where `d` is the gradient (plus
/// `weight_decay * p`), or with momentum the buffer
/// `b = momentum * b + (1 - dampening) * d` (`b = d` on the first step),
/// or with Nesterov `d + momentum * b`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: none, and no state is kept).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl Sgd {
    /// Plain SGD with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        Sgd {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// With momentum.
    pub fn momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// With weight decay (L2, added to the gradient).
    pub fn weight_decay(mut self, wd: f64) -> Self {
        self.weight_decay = wd;
        self
    }

    pub(crate) fn update<T: Real>(&self, step: u64, p: &mut [T], g: &[T], state: &mut [&mut [T]]) {
        let (lr, mu, wd) = (
            T::of(self.lr),
            T::of(self.momentum),
            T::of(self.weight_decay),
        );
        let keep = T::of(1.0 - self.dampening);
        let buf = state.first_mut();
        match buf {
            Some(buf) => {
                for ((p, &g), b) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
                    let d = if self.weight_decay != 0.0 {
                        g + wd * *p
                    } else {
                        g
                    };
                    *b = if step <= 1 { d } else { mu * *b + keep * d };
                    let d = if self.nesterov { d + mu * *b } else { *b };
                    *p = p.sub(lr * d);
                }
            }
            None => {
                for (p, &g) in p.iter_mut().zip(g) {
                    let d = if self.weight_decay != 0.0 {
                        g + wd * *p
                    } else {
                        g
                    };
                    *p = p.sub(lr * d);
                }
            }
        }
    }
}

/// `torch.optim.AdamW`: decoupled weight decay `p *= 1 - lr * wd`, then
/// Adam with bias correction: `m`, `v` are the first and second moment
/// (two state slots).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// Learning rate (torch: 1e-3).
    pub lr: f64,
    /// First-moment decay (0.9).
    pub beta1: f64,
    /// Second-moment decay (0.999).
    pub beta2: f64,
    /// Added to the denominator (1e-8).
    pub eps: f64,
    /// Decoupled weight decay (0.01).
    pub weight_decay: f64,
}

impl AdamW {
    /// torch's defaults, with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }

    pub(crate) fn update<T: Real>(&self, step: u64, p: &mut [T], g: &[T], state: &mut [&mut [T]]) {
        let t = step.max(1) as i32;
        let bc1 = 1.0 - self.beta1.powi(t);
        let bc2 = 1.0 - self.beta2.powi(t);
        let decay = T::of(1.0 - self.lr * self.weight_decay);
        let (b1, b2) = (T::of(self.beta1), T::of(self.beta2));
        let (c1, c2) = (T::of(1.0 - self.beta1), T::of(1.0 - self.beta2));
        let step_size = T::of(self.lr / bc1);
        let bc2_sqrt = T::of(bc2.sqrt());
        let eps = T::of(self.eps);
        let [m, v] = state else {
            unreachable!("AdamW keeps two state slots")
        };
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            *p = *p * decay;
            *m = b1 * *m + c1 * g;
            *v = b2 * *v + c2 * g * g;
            let denom = v.sqrt().div(bc2_sqrt) + eps;
            *p = p.sub(step_size * m.div(denom));
        }
    }
}
