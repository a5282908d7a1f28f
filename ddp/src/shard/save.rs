//! Checkpoints of a [`Sharded`] model: a full state dict gathered to rank
//! 0 (the keys DDP's checkpoints use, which PyTorch loads), and sharded
//! checkpoints that every rank writes its part of and that resume at
//! another world size or strategy.
//!
//! A sharded checkpoint is a directory:
//! - `shard-K-of-N-ID.safetensors`, one per shard: the real (unpadded)
//!   part of shard K of every flat buffer, its parameters
//!   (`flat{f}.param`) and optimizer slots (`flat{f}.state{s}`);
//! - `index.json`, written by rank 0 after every shard file is in place:
//!   each parameter's name, dtype, shape and place in the flats, the
//!   shard files, the optimizer and its step count.
//!
//! Every file is written atomically and the index names its shard files
//! by the save's ID, so a save that dies half-way leaves the previous
//! checkpoint whole. The directory must be visible to every rank (a
//! shared filesystem, as torch's distributed checkpoints need).

use std::{collections::BTreeMap, path::Path};

use consort_comm::{BufferMut, CallOptions, ReduceOp};
use serde::{Deserialize, Serialize};

use super::{Sharded, Vals};
use crate::{
    checkpoint::{save_safetensors, write_atomic},
    error::DdpError,
    state_dict::StateDict,
    tensor::Tensor,
};

/// The index file's format tag.
pub(super) const FORMAT: &str = "consort-sharded/1";

/// `index.json`.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Index {
    pub(super) format: String,
    pub(super) strategy: String,
    pub(super) shards: usize,
    pub(super) id: String,
    pub(super) steps: u64,
    /// Mixed precision's loss scale and its good steps in a row (absent
    /// without loss scaling, and in checkpoints from before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) loss_scale: Option<(f64, u64)>,
    pub(super) optimizer: String,
    pub(super) slots: usize,
    pub(super) files: Vec<String>,
    pub(super) flats: Vec<FlatEntry>,
    pub(super) params: Vec<ParamEntry>,
    pub(super) metadata: BTreeMap<String, String>,
}

/// One flat buffer in the index.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct FlatEntry {
    pub(super) unit: usize,
    pub(super) dtype: String,
    pub(super) numel: usize,
    pub(super) shard_len: usize,
}

/// One parameter in the index.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct ParamEntry {
    pub(super) name: String,
    pub(super) dtype: String,
    pub(super) shape: Vec<usize>,
    pub(super) flat: usize,
    pub(super) offset: usize,
}

impl Sharded {
    /// The whole parameters as a state dict, on rank 0 (`None` elsewhere),
    /// keyed by the model's names like DDP's state dicts. Every rank calls
    /// it (FSDP and HSDP gather each unit).
    pub async fn full_state_dict(&mut self) -> Result<Option<StateDict>, DdpError> {
        self.enter("full_state_dict")?;
        let out = self.full_state_dict_inner().await;
        self.leave();
        out
    }

    async fn full_state_dict_inner(&mut self) -> Result<Option<StateDict>, DdpError> {
        let mut sd = StateDict::new();
        // Rank 0 gathers every unit even after a failed read, so that the
        // others' gathers find it; the first error is returned at the end.
        let mut first = None;
        for u in 0..self.layout.units.len() {
            let g = self.gather_master(u).await?;
            if self.rank != 0 || first.is_some() {
                continue;
            }
            for &p in &self.layout.units[u] {
                let spec = &self.specs[p];
                let t = g.param_bytes(p).and_then(|bytes| {
                    Tensor::new(spec.dtype, spec.shape.clone(), bytes).map_err(|e| {
                        DdpError::Checkpoint {
                            rank: self.rank,
                            reason: e.to_string(),
                        }
                    })
                });
                match t {
                    Ok(t) => {
                        sd.insert(spec.name.clone(), t);
                    }
                    Err(e) => {
                        first = Some(e);
                        break;
                    }
                }
            }
        }
        if let Some(e) = first {
            return Err(e);
        }
        Ok((self.rank == 0).then_some(sd))
    }

    /// Writes the full state dict (plus `extra`, such as the model's
    /// buffers) to `path` on rank 0, atomically, as safetensors with the
    /// same keys as a DDP checkpoint; every rank learns whether it worked.
    pub async fn save_full_checkpoint(
        &mut self,
        path: &Path,
        extra: &StateDict,
        metadata: &BTreeMap<String, String>,
    ) -> Result<(), DdpError> {
        self.enter("save_full_checkpoint")?;
        let out = self.save_full_inner(path, extra, metadata).await;
        self.leave();
        out
    }

    async fn save_full_inner(
        &mut self,
        path: &Path,
        extra: &StateDict,
        metadata: &BTreeMap<String, String>,
    ) -> Result<(), DdpError> {
        let sd = self.full_state_dict_inner().await?;
        let mut reason = String::new();
        if let Some(mut sd) = sd {
            sd.tensors
                .extend(extra.tensors.iter().map(|(k, v)| (k.clone(), v.clone())));
            if let Err(e) = save_safetensors(path, &sd, metadata) {
                reason = e.to_string();
            }
        }
        let what = format!("writing {}", path.display());
        self.agree(&what, reason).await
    }

    /// Every rank's outcome of `what`: an error on every rank if any
    /// failed (`reason` non-empty here).
    pub(super) async fn agree(&mut self, what: &str, reason: String) -> Result<(), DdpError> {
        let mut flag = [u32::from(!reason.is_empty())];
        self.backend
            .all_reduce(
                BufferMut::from(&mut flag[..]),
                ReduceOp::Max,
                &self.slow_call(),
            )
            .await
            .map_err(|e| {
                let e = self.comm_error(format!("all_reduce of the status of {what}"), e);
                self.fail(e)
            })?;
        match (flag[0], reason.is_empty()) {
            (0, _) => Ok(()),
            (_, false) => Err(DdpError::Checkpoint {
                rank: self.rank,
                reason,
            }),
            (_, true) => Err(DdpError::Checkpoint {
                rank: self.rank,
                reason: format!("another rank failed {what} (see its error)"),
            }),
        }
    }

    /// Options for a call that waits on another rank's file I/O: at least
    /// ten minutes, whatever the step's deadline.
    fn slow_call(&self) -> CallOptions {
        let t = self.call.timeout_or(self.backend.default_timeout());
        CallOptions {
            timeout: Some(t.max(std::time::Duration::from_secs(600))),
            ..self.call
        }
    }

    /// Writes a sharded checkpoint to `dir` (created if missing): this
    /// rank's shard of parameters and optimizer state (under HSDP, the
    /// first replica group writes), then rank 0's index. Call it between
    /// steps, on every rank.
    pub async fn save_sharded(
        &mut self,
        dir: &Path,
        metadata: &BTreeMap<String, String>,
    ) -> Result<(), DdpError> {
        self.enter("save_sharded")?;
        let out = self.save_sharded_inner(dir, metadata).await;
        self.leave();
        out
    }

    async fn save_sharded_inner(
        &mut self,
        dir: &Path,
        metadata: &BTreeMap<String, String>,
    ) -> Result<(), DdpError> {
        self.between_steps("save_sharded")?;
        let mut id = [0u64];
        if self.rank == 0 {
            id[0] = next_id(dir);
        }
        let root = CallOptions {
            root: 0,
            ..self.slow_call()
        };
        self.backend
            .broadcast(BufferMut::from(&mut id[..]), &root)
            .await
            .map_err(|e| {
                let e = self.comm_error("broadcast of the checkpoint id", e);
                self.fail(e)
            })?;
        let id = format!("{:016x}", id[0]);
        let (k, n) = self.shard();
        let files: Vec<String> = (0..n)
            .map(|k| format!("shard-{k:05}-of-{n:05}-{id}.safetensors"))
            .collect();
        let writes = self.rank < n;
        let mut reason = String::new();
        if writes {
            if let Err(e) = std::fs::create_dir_all(dir) {
                reason = format!("cannot create {}: {e}", dir.display());
            } else if let Err(e) = self.write_shard(&dir.join(&files[k])) {
                reason = e;
            }
        }
        self.agree("writing the shard files", reason).await?;
        let mut reason = String::new();
        if self.rank == 0 {
            if let Err(e) = self.write_index(dir, &id, &files, metadata) {
                reason = e;
            } else {
                remove_stale(dir, &files);
            }
        }
        self.agree("writing index.json", reason).await
    }

    /// This rank's shard file.
    fn write_shard(&self, path: &Path) -> Result<(), String> {
        let k = self.group.index;
        let mut sd = StateDict::new();
        for (f, (flat, fs)) in self.layout.flats.iter().zip(&self.flats).enumerate() {
            let n = flat.valid_range(k).len();
            let at = if self.strategy.shards_params() {
                0
            } else {
                flat.shard_range(k).start
            };
            let mut put = |name: String, v: &Vals, from: usize| {
                let bytes = v
                    .read_bytes(from..from + n)
                    .map_err(|e| format!("reading the shard from the device: {e}"))?
                    .into_owned();
                Tensor::new(flat.dtype, vec![n], bytes)
                    .map(|t| sd.insert(name, t))
                    .map_err(|e| e.to_string())
            };
            put(format!("flat{f}.param"), &fs.params, at)?;
            for (s, v) in fs.state.iter().enumerate() {
                put(format!("flat{f}.state{s}"), v, 0)?;
            }
        }
        let mut meta = BTreeMap::new();
        meta.insert("consort.shard".to_string(), k.to_string());
        save_safetensors(path, &sd, &meta).map_err(|e| e.to_string())
    }

    /// Rank 0's `index.json`.
    fn write_index(
        &self,
        dir: &Path,
        id: &str,
        files: &[String],
        metadata: &BTreeMap<String, String>,
    ) -> Result<(), String> {
        let index = Index {
            format: FORMAT.into(),
            strategy: self.strategy.name().into(),
            shards: self.layout.shards,
            id: id.into(),
            steps: self.steps,
            loss_scale: self.scaler.as_ref().map(super::mixed::Scaler::state),
            optimizer: self.optimizer.name().into(),
            slots: self.optimizer.slots(),
            files: files.to_vec(),
            flats: self
                .layout
                .flats
                .iter()
                .map(|f| FlatEntry {
                    unit: f.unit,
                    dtype: f.dtype.name().into(),
                    numel: f.numel,
                    shard_len: f.shard_len,
                })
                .collect(),
            params: (0..self.specs.len())
                .map(|p| {
                    let (f, r) = self.layout.range_of(p);
                    let s = &self.specs[p];
                    ParamEntry {
                        name: s.name.clone(),
                        dtype: s.dtype.name().into(),
                        shape: s.shape.clone(),
                        flat: f,
                        offset: r.start,
                    }
                })
                .collect(),
            metadata: metadata.clone(),
        };
        let json = serde_json::to_vec_pretty(&index).map_err(|e| e.to_string())?;
        write_atomic(&dir.join("index.json"), &json).map_err(|e| e.to_string())
    }

    /// A usage error unless no gradient of this step has been marked.
    pub(super) fn between_steps(&self, what: &str) -> Result<(), DdpError> {
        if self.ready.iter().any(|&r| r) {
            return Err(DdpError::Usage {
                rank: self.rank,
                reason: format!(
                    "{what} in the middle of a step (gradients are marked): call it after step()"
                ),
            });
        }
        Ok(())
    }
}

/// A save id after the one `dir`'s index holds (ids name the shard
/// files, so a new save never overwrites the files the index points at):
/// the wall clock in nanoseconds, or one more than the old id.
fn next_id(dir: &Path) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let old = consort_comm::files::read_regular(&dir.join("index.json"), 64 << 20)
        .ok()
        .and_then(|t| serde_json::from_slice::<Index>(&t).ok())
        .and_then(|i| u64::from_str_radix(&i.id, 16).ok());
    match old {
        Some(old) => now.max(old.saturating_add(1)),
        None => now,
    }
}

/// Removes shard files of earlier saves that the new index does not name.
fn remove_stale(dir: &Path, keep: &[String]) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let stale = name.starts_with("shard-") && name.ends_with(".safetensors");
        // A temporary file of a save that died (every write of this one
        // has finished by now).
        let dead = name.starts_with(".shard-") && name.contains(".safetensors.tmp-");
        if (stale && !keep.contains(&name)) || dead {
            let _ = std::fs::remove_file(e.path());
        }
    }
}
