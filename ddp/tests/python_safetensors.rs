//! Our safetensors files against Python's `safetensors` (numpy and torch
//! loaders), both directions. Needs a python with torch, numpy and
//! safetensors, named by `CONSORT_TORCH_PYTHON`; without it the tests
//! print why they skip and pass. CI sets it.

use std::{collections::BTreeMap, process::Command};

use consort_comm::half::{bf16, f16};
use consort_ddp::{Tensor, load_safetensors, save_safetensors, state_dict::StateDict};

fn python(test: &str) -> Option<String> {
    match std::env::var("CONSORT_TORCH_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            eprintln!(
                "skipped {test}: set CONSORT_TORCH_PYTHON to a python with torch, numpy and \
                 safetensors to run it"
            );
            None
        }
    }
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("consort-st-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn python_loads_what_we_write() {
    let Some(py) = python("python_loads_what_we_write") else {
        return;
    };
    let dir = scratch("ours");
    let path = dir.join("model.safetensors");
    let mut sd = StateDict::new();
    sd.insert(
        "fc.weight",
        Tensor::from_slice::<f32>(vec![2, 3], &[1.0, -2.5, 3.0, 4.0, 5.0, 6.25]).unwrap(),
    );
    sd.insert(
        "fc.bias",
        Tensor::from_slice(vec![2], &[f16::from_f32(0.5), f16::from_f32(-1.0)]).unwrap(),
    );
    sd.insert(
        "emb",
        Tensor::from_slice(vec![1, 2], &[bf16::from_f32(2.0), bf16::from_f32(3.0)]).unwrap(),
    );
    sd.insert("steps", Tensor::from_slice(vec![], &[42i64]).unwrap());
    sd.insert("mask", Tensor::from_slice(vec![3], &[1u8, 0, 1]).unwrap());
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    save_safetensors(&path, &sd, &meta).unwrap();

    let script = r#"
import sys, json
from safetensors import safe_open
from safetensors.torch import load_file
t = load_file(sys.argv[1])
with safe_open(sys.argv[1], framework="np") as f:
    meta = f.metadata()
    w = f.get_tensor("fc.weight")
out = {
  "keys": sorted(t.keys()),
  "dtypes": {k: str(v.dtype) for k, v in t.items()},
  "shapes": {k: list(v.shape) for k, v in t.items()},
  "values": {k: v.float().flatten().tolist() for k, v in t.items()},
  "np_weight": w.tolist(),
  "meta": meta,
}
print(json.dumps(out))
"#;
    let out = Command::new(py)
        .args(["-c", script, path.to_str().unwrap()])
        .output()
        .expect("start python");
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["keys"],
        serde_json::json!(["emb", "fc.bias", "fc.weight", "mask", "steps"])
    );
    assert_eq!(
        v["dtypes"],
        serde_json::json!({"emb": "torch.bfloat16", "fc.bias": "torch.float16",
            "fc.weight": "torch.float32", "mask": "torch.uint8", "steps": "torch.int64"})
    );
    assert_eq!(v["shapes"]["fc.weight"], serde_json::json!([2, 3]));
    assert_eq!(v["shapes"]["steps"], serde_json::json!([]));
    assert_eq!(
        v["values"]["fc.weight"],
        serde_json::json!([1.0, -2.5, 3.0, 4.0, 5.0, 6.25])
    );
    assert_eq!(v["values"]["fc.bias"], serde_json::json!([0.5, -1.0]));
    assert_eq!(v["values"]["emb"], serde_json::json!([2.0, 3.0]));
    assert_eq!(v["values"]["steps"], serde_json::json!([42.0]));
    assert_eq!(v["values"]["mask"], serde_json::json!([1.0, 0.0, 1.0]));
    assert_eq!(
        v["np_weight"],
        serde_json::json!([[1.0, -2.5, 3.0], [4.0, 5.0, 6.25]])
    );
    assert_eq!(v["meta"], serde_json::json!({"format": "pt"}));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn we_load_what_torch_writes_from_a_ddp_model() {
    let Some(py) = python("we_load_what_torch_writes_from_a_ddp_model") else {
        return;
    };
    let dir = scratch("theirs");
    let path = dir.join("ddp.safetensors");
    // A DDP-style state dict (module. prefix), saved by torch.
    let script = r#"
import sys, torch
from safetensors.torch import save_file
sd = {"module.fc.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
      "module.fc.bias": torch.tensor([1.5, -2.0], dtype=torch.float64)}
save_file(sd, sys.argv[1], metadata={"saved_by": "torch"})
"#;
    let out = Command::new(py)
        .args(["-c", script, path.to_str().unwrap()])
        .output()
        .expect("start python");
    assert!(out.status.success(), "{out:?}");
    let (sd, meta) = load_safetensors(&path).unwrap();
    assert_eq!(meta["saved_by"], "torch");
    // Loads into a bare model: the prefix is handled.
    let mut model = StateDict::new();
    model.insert(
        "fc.weight",
        Tensor::from_slice::<f32>(vec![2, 3], &[0.0; 6]).unwrap(),
    );
    model.insert(
        "fc.bias",
        Tensor::from_slice(vec![2], &[0.0f64, 0.0]).unwrap(),
    );
    let loaded = sd.load_into(&model).unwrap();
    assert_eq!(
        loaded.tensors["fc.weight"].to_vec::<f32>().unwrap(),
        vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    );
    assert_eq!(
        loaded.tensors["fc.bias"].to_vec::<f64>().unwrap(),
        vec![1.5, -2.0]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A sharded model's checkpoints from Python: torch loads the full state
/// dict (DDP's keys), and rebuilding every parameter from the shard files
/// and index.json alone gives the same tensors, bit for bit.
#[test]
fn python_reads_a_sharded_models_checkpoints() {
    let Some(py) = python("python_reads_a_sharded_models_checkpoints") else {
        return;
    };
    use std::sync::Arc;

    use consort_comm::Backend;
    use consort_ddp::{AdamW, PlainModel, ShardOptions, Sharded, Strategy};
    use consort_sim::{SimConfig, SimWorld};
    let dir = scratch("sharded");
    let world = SimWorld::new(SimConfig::new(3)).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let tasks: Vec<_> = world
            .ranks()
            .into_iter()
            .map(|r| {
                let dir = dir.clone();
                tokio::spawn(async move {
                    let b: Arc<dyn Backend> = Arc::new(r);
                    let mut m = PlainModel::new();
                    let w: Vec<f32> = (0..35).map(|i| i as f32 * 0.25 - 3.0).collect();
                    m.add_param("fc1.weight", vec![7, 5], &w).unwrap();
                    m.add_param("fc1.bias", vec![7], &[0.5f32; 7]).unwrap();
                    m.add_param("fc2.weight", vec![2, 7], &[1.5f64; 14])
                        .unwrap();
                    let opts = ShardOptions::new(Strategy::Fsdp).units(vec![vec![0, 1], vec![2]]);
                    let mut sh = Sharded::new(b, &mut m, AdamW::new(0.1), opts)
                        .await
                        .unwrap();
                    for p in [2usize, 1, 0] {
                        let n = sh.params()[p].numel();
                        if p == 2 {
                            sh.mark_ready(p, &vec![0.25f64; n]).unwrap();
                        } else {
                            sh.mark_ready(p, &vec![-0.5f32; n]).unwrap();
                        }
                    }
                    sh.step().await.unwrap();
                    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
                    sh.save_full_checkpoint(
                        &dir.join("full.safetensors"),
                        &StateDict::new(),
                        &meta,
                    )
                    .await
                    .unwrap();
                    sh.save_sharded(&dir.join("sharded"), &meta).await.unwrap();
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
    let script = r#"
import sys, json, os, torch
from safetensors.torch import load_file
d = sys.argv[1]
full = load_file(os.path.join(d, "full.safetensors"))
index = json.load(open(os.path.join(d, "sharded", "index.json")))
shards = [load_file(os.path.join(d, "sharded", f)) for f in index["files"]]
flats = [torch.cat([s[f"flat{f}.param"] for s in shards]) for f in range(len(index["flats"]))]
for p in index["params"]:
    n = 1
    for x in p["shape"]:
        n *= x
    t = flats[p["flat"]][p["offset"]:p["offset"] + n].reshape(p["shape"])
    assert torch.equal(t, full[p["name"]]), p["name"]
assert index["optimizer"] == "adamw" and index["steps"] == 1 and index["shards"] == 3
print(json.dumps(sorted((k, str(v.dtype), list(v.shape)) for k, v in full.items())))
"#;
    let out = Command::new(py)
        .args(["-c", script])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(r#"["fc1.bias", "torch.float32", [7]]"#)
            && text.contains(r#"["fc2.weight", "torch.float64", [2, 7]]"#),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
