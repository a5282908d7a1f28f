//! The two-layer burn model the adapter's tests train.

use burn::{
    Tensor,
    module::Module,
    nn::{Linear, LinearConfig},
    tensor::{Device, activation::relu},
};

#[derive(Module, Debug)]
pub(crate) struct Net {
    pub(crate) fc1: Linear,
    pub(crate) fc2: Linear,
}

impl Net {
    /// A 4 → 8 → 3 MLP, freshly initialized on `device`.
    pub(crate) fn new(device: &Device) -> Self {
        Net {
            fc1: LinearConfig::new(4, 8).init(device),
            fc2: LinearConfig::new(8, 3).init(device),
        }
    }

    /// `[n, 4]` inputs to `[n, 3]` outputs.
    pub(crate) fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(relu(self.fc1.forward(x)))
    }
}
