//! A small GPT-style language model from burn's `nn`: token and position
//! embeddings, causal self-attention blocks (pre-norm, GELU MLP), a final
//! layer norm and a linear head over the vocabulary.

// burn's derive names `burn::...`: through consort's re-export here.
use consort::burn::burn;
use consort::burn::burn::{
    Tensor,
    module::Module,
    nn::{
        Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig,
        attention::generate_autoregressive_mask,
        loss::CrossEntropyLossConfig,
        transformer::{TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput},
    },
    tensor::{Device, Int},
};

/// The model's sizes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sizes {
    pub(crate) vocab: usize,
    pub(crate) context: usize,
    pub(crate) d_model: usize,
    pub(crate) heads: usize,
    pub(crate) layers: usize,
}

#[derive(Module, Debug)]
pub(crate) struct Gpt {
    tokens: Embedding,
    positions: Embedding,
    blocks: TransformerEncoder,
    norm: LayerNorm,
    head: Linear,
}

impl Gpt {
    pub(crate) fn new(s: Sizes, device: &Device) -> Self {
        let blocks = TransformerEncoderConfig::new(s.d_model, 4 * s.d_model, s.heads, s.layers)
            .with_dropout(0.0)
            .with_norm_first(true);
        Gpt {
            tokens: EmbeddingConfig::new(s.vocab, s.d_model).init(device),
            positions: EmbeddingConfig::new(s.context, s.d_model).init(device),
            blocks: blocks.init(device),
            norm: LayerNormConfig::new(s.d_model).init(device),
            head: LinearConfig::new(s.d_model, s.vocab).init(device),
        }
    }

    /// Next-token logits `[batch, seq, vocab]` for token ids `[batch, seq]`.
    pub(crate) fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let [batch, seq] = ids.dims();
        let device = ids.device();
        let pos = Tensor::<1, Int>::arange(0..seq as i64, &device)
            .reshape([1, seq])
            .repeat_dim(0, batch);
        let x = self.tokens.forward(ids) + self.positions.forward(pos);
        let mask = generate_autoregressive_mask(batch, seq, &device);
        let x = self
            .blocks
            .forward(TransformerEncoderInput::new(x).mask_attn(mask));
        self.head.forward(self.norm.forward(x))
    }

    /// The mean cross entropy of predicting `targets` `[batch, seq]`.
    pub(crate) fn loss(&self, ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        let logits = self.forward(ids);
        let [batch, seq, vocab] = logits.dims();
        let ce = CrossEntropyLossConfig::new().init(&logits.device());
        ce.forward(
            logits.reshape([batch * seq, vocab]),
            targets.reshape([batch * seq]),
        )
    }
}
