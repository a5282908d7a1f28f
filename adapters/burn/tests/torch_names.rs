//! A burn model's checkpoint in torch's names and layouts: the same model
//! written with `torch.nn` loads it with `load_state_dict(strict=True)` and
//! computes the same outputs, and a checkpoint torch writes loads back
//! into the burn model. Needs a python with torch and safetensors, named
//! by `CONSORT_TORCH_PYTHON`, for the torch half (without it that half
//! prints why it skips; CI sets it).

use std::process::Command;

use burn::{
    Tensor,
    module::Module,
    nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig},
    tensor::{Device, Int, TensorData, activation::relu},
};
use consort_burn::BurnModel;
use consort_ddp::{load_safetensors, save_safetensors};

#[derive(Module, Debug)]
struct Small {
    emb: Embedding,
    norm: LayerNorm,
    blocks: Vec<Linear>,
    head: Linear,
}

const VOCAB: usize = 11;
const D: usize = 6;
const HIDDEN: usize = 9;
const TOKENS: [i64; 5] = [1, 4, 2, 7, 10];

impl Small {
    fn new(device: &Device) -> Self {
        Small {
            emb: EmbeddingConfig::new(VOCAB, D).init(device),
            norm: LayerNormConfig::new(D).init(device),
            blocks: vec![
                LinearConfig::new(D, HIDDEN).init(device),
                LinearConfig::new(HIDDEN, D).init(device),
            ],
            head: LinearConfig::new(D, VOCAB).init(device),
        }
    }

    /// Logits for [`TOKENS`], flattened.
    fn logits(&self, device: &Device) -> Vec<f32> {
        let t = Tensor::<2, Int>::from_data(TensorData::new(TOKENS.to_vec(), [1, 5]), device);
        let mut x = self.norm.forward(self.emb.forward(t));
        for b in &self.blocks {
            x = relu(b.forward(x));
        }
        let y = self.head.forward(x);
        y.into_data().try_to_vec::<f32>().expect("f32 logits")
    }
}

/// The same model in torch, the logits of TOKENS under a state dict, and
/// the state dict scaled by 1/2 written back (the burn side loads it).
const TORCH: &str = r#"
import json, sys, torch
from safetensors.torch import load_file, save_file
from torch import nn
class Small(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(11, 6)
        s.norm = nn.LayerNorm(6)
        s.blocks = nn.ModuleList([nn.Linear(6, 9), nn.Linear(9, 6)])
        s.head = nn.Linear(6, 11)
    def forward(s, t):
        x = s.norm(s.emb(t))
        for b in s.blocks:
            x = torch.relu(b(x))
        return s.head(x)
m = Small()
m.load_state_dict(load_file(sys.argv[1]), strict=True)
t = torch.tensor([[1, 4, 2, 7, 10]])
with torch.no_grad():
    out = {"logits": m(t).flatten().tolist()}
    for p in m.parameters():
        p.mul_(0.5)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, sys.argv[2])
    out["halved"] = m(t).flatten().tolist()
print(json.dumps(out))
"#;

fn close(a: &[f32], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (f64::from(*x) - y).abs() < 1e-4,
            "{what}: logit {i}: burn {x}, torch {y}"
        );
    }
}

#[test]
fn torch_loads_a_burn_checkpoint_and_burn_loads_torch_s() {
    let device = Device::default();
    let model = Small::new(&device);
    let mut host = BurnModel::from_module(&model).unwrap();
    assert_eq!(
        host.torch_names(),
        [
            "emb.weight",
            "norm.weight",
            "norm.bias",
            "blocks.0.weight",
            "blocks.0.bias",
            "blocks.1.weight",
            "blocks.1.bias",
            "head.weight",
            "head.bias"
        ]
    );
    let sd = host.torch_state_dict();
    assert_eq!(
        sd.tensors["head.weight"].shape,
        [VOCAB, D],
        "torch's [out, in]"
    );
    assert_eq!(sd.tensors["emb.weight"].shape, [VOCAB, D]);
    // Our own round trip: the torch view loads back to the same values.
    let before = host.state_dict();
    host.load_torch_state_dict(&sd).unwrap();
    assert_eq!(host.state_dict(), before);

    let dir = std::env::temp_dir().join(format!("consort-burn-torch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ours, theirs) = (dir.join("burn.safetensors"), dir.join("torch.safetensors"));
    save_safetensors(&ours, &sd, &Default::default()).unwrap();
    let Some(python) = std::env::var("CONSORT_TORCH_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
    else {
        eprintln!("skipped the torch half: set CONSORT_TORCH_PYTHON to a python with torch");
        return;
    };
    let out = Command::new(python)
        .args(["-c", TORCH])
        .arg(&ours)
        .arg(&theirs)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "torch refused the checkpoint: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let list = |k: &str| -> Vec<f64> {
        got[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    close(
        &model.logits(&device),
        &list("logits"),
        "torch on burn's checkpoint",
    );

    let (back, _) = load_safetensors(&theirs).unwrap();
    host.load_torch_state_dict(&back).unwrap();
    let halved = host.push_values(model).unwrap();
    close(
        &halved.logits(&device),
        &list("halved"),
        "burn on torch's checkpoint",
    );
    let _ = std::fs::remove_dir_all(&dir);
}
