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

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
};

use consort_comm::{BufferMut, CallOptions, DType, ReduceOp};
use serde::{Deserialize, Serialize};

use super::{Sharded, Vals};
use crate::{
    checkpoint::{load_safetensors, save_safetensors, write_atomic},
    error::DdpError,
    state_dict::StateDict,
    tensor::Tensor,
};

/// The index file's format tag.
const FORMAT: &str = "consort-sharded/1";

/// `index.json`.
#[derive(Debug, Serialize, Deserialize)]
struct Index {
    format: String,
    strategy: String,
    shards: usize,
    id: String,
    steps: u64,
    optimizer: String,
    slots: usize,
    files: Vec<String>,
    flats: Vec<FlatEntry>,
    params: Vec<ParamEntry>,
    metadata: BTreeMap<String, String>,
}

/// One flat buffer in the index.
#[derive(Debug, Serialize, Deserialize)]
struct FlatEntry {
    unit: usize,
    dtype: String,
    numel: usize,
    shard_len: usize,
}

/// One parameter in the index.
#[derive(Debug, Serialize, Deserialize)]
struct ParamEntry {
    name: String,
    dtype: String,
    shape: Vec<usize>,
    flat: usize,
    offset: usize,
}

impl Sharded {
    /// The whole parameters as a state dict, on rank 0 (`None` elsewhere),
    /// keyed by the model's names like DDP's state dicts. Every rank calls
    /// it (FSDP and HSDP gather each unit).
    pub async fn full_state_dict(&mut self) -> Result<Option<StateDict>, DdpError> {
        let mut sd = StateDict::new();
        for u in 0..self.layout.units.len() {
            let g = self.gather(u).await?;
            if self.rank != 0 {
                continue;
            }
            for &p in &self.layout.units[u] {
                let spec = &self.specs[p];
                let bytes = param_bytes(&g, p, spec.dtype)?;
                let t = Tensor::new(spec.dtype, spec.shape.clone(), bytes).map_err(|e| {
                    DdpError::Checkpoint {
                        rank: self.rank,
                        reason: e.to_string(),
                    }
                })?;
                sd.insert(spec.name.clone(), t);
            }
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
        let sd = self.full_state_dict().await?;
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
    async fn agree(&mut self, what: &str, reason: String) -> Result<(), DdpError> {
        let mut flag = [u32::from(!reason.is_empty())];
        self.backend
            .all_reduce(BufferMut::from(&mut flag[..]), ReduceOp::Max, &self.call)
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

    /// Writes a sharded checkpoint to `dir` (created if missing): this
    /// rank's shard of parameters and optimizer state (under HSDP, the
    /// first replica group writes), then rank 0's index. Call it between
    /// steps, on every rank.
    pub async fn save_sharded(
        &mut self,
        dir: &Path,
        metadata: &BTreeMap<String, String>,
    ) -> Result<(), DdpError> {
        self.check()?;
        self.between_steps("save_sharded")?;
        let mut id = [0u64];
        if self.rank == 0 {
            id[0] = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
        }
        let root = CallOptions {
            root: 0,
            ..self.call
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
                let bytes = v.range_bytes(from..from + n).to_vec();
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
    fn between_steps(&self, what: &str) -> Result<(), DdpError> {
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

    /// Loads a sharded checkpoint written at any world size and by any
    /// strategy, into this rank's part of the flat buffers: parameters,
    /// optimizer state and the step count. Returns the metadata given to
    /// [`Sharded::save_sharded`]. Every rank calls it between steps.
    pub async fn load_sharded(&mut self, dir: &Path) -> Result<BTreeMap<String, String>, DdpError> {
        self.check()?;
        self.between_steps("load_sharded")?;
        let loaded = self.read_sharded(dir);
        let reason = loaded.as_ref().err().cloned().unwrap_or_default();
        let what = format!("loading the sharded checkpoint {}", dir.display());
        self.agree(&what, reason).await?;
        let (steps, metadata) = loaded.unwrap_or_default();
        self.steps = steps;
        Ok(metadata)
    }

    /// Reads and checks the index, then fills this rank's buffers.
    fn read_sharded(&mut self, dir: &Path) -> Result<(u64, BTreeMap<String, String>), String> {
        let at = dir.join("index.json");
        let text = std::fs::read(&at).map_err(|e| {
            format!(
                "cannot read {}: {e} (no complete sharded checkpoint there; save_sharded writes \
                 it last)",
                at.display()
            )
        })?;
        let index: Index = serde_json::from_slice(&text)
            .map_err(|e| format!("{} is not a sharded checkpoint index: {e}", at.display()))?;
        self.check_index(&index, &at)?;
        let mut files = ShardFiles {
            dir: dir.to_path_buf(),
            index: &index,
            loaded: HashMap::new(),
        };
        let by_name: HashMap<&str, &ParamEntry> =
            index.params.iter().map(|p| (p.name.as_str(), p)).collect();
        let k = self.group.index;
        for f in 0..self.flats.len() {
            let flat = self.layout.flats[f].clone();
            let mine = flat.valid_range(k);
            let (need, base) = if self.strategy.shards_params() {
                (mine.clone(), mine.start)
            } else {
                (0..flat.numel, 0)
            };
            for seg in &flat.segments {
                let old = by_name[self.specs[seg.param].name.as_str()];
                let fs = &mut self.flats[f];
                let params = std::sync::Arc::make_mut(&mut fs.params);
                files.copy(seg, old, &need, base, "param", params)?;
                for (s, v) in fs.state.iter_mut().enumerate() {
                    files.copy(seg, old, &mine, mine.start, &format!("state{s}"), v)?;
                }
            }
        }
        Ok((index.steps, index.metadata.clone()))
    }

    /// The index fits this model and optimizer.
    fn check_index(&self, index: &Index, at: &Path) -> Result<(), String> {
        if index.format != FORMAT {
            return Err(format!(
                "{} has format {:?}; this consort reads {FORMAT:?}",
                at.display(),
                index.format
            ));
        }
        if index.optimizer != self.optimizer.name() || index.slots != self.optimizer.slots() {
            return Err(format!(
                "{} holds {} state ({} slot(s) per element), but this run's optimizer is {} ({} \
                 slot(s)); resume with the same optimizer",
                at.display(),
                index.optimizer,
                index.slots,
                self.optimizer.name(),
                self.optimizer.slots()
            ));
        }
        let theirs: HashMap<&str, &ParamEntry> =
            index.params.iter().map(|p| (p.name.as_str(), p)).collect();
        for s in &self.specs {
            match theirs.get(s.name.as_str()) {
                None => {
                    return Err(format!(
                        "{} has no parameter {} (it holds {} parameters); is it this model's?",
                        at.display(),
                        s.name,
                        index.params.len()
                    ));
                }
                Some(p) if p.dtype != s.dtype.name() || p.shape != s.shape => {
                    return Err(format!(
                        "{}: parameter {} is {} {:?} there but {} here",
                        at.display(),
                        s.name,
                        p.dtype,
                        p.shape,
                        s.describe()
                    ));
                }
                Some(p) if index.flats.get(p.flat).is_none() => {
                    return Err(format!(
                        "{}: parameter {} names no flat",
                        at.display(),
                        s.name
                    ));
                }
                Some(_) => {}
            }
        }
        if index.params.len() != self.specs.len() {
            return Err(format!(
                "{} holds {} parameters, this model {}",
                at.display(),
                index.params.len(),
                self.specs.len()
            ));
        }
        if index.files.len() != index.shards || index.shards == 0 {
            return Err(format!(
                "{}: {} shard files for {} shards",
                at.display(),
                index.files.len(),
                index.shards
            ));
        }
        Ok(())
    }
}

/// Parameter `p`'s bytes from a gathered unit.
fn param_bytes(g: &super::step::Gathered, p: usize, dtype: DType) -> Result<Vec<u8>, DdpError> {
    Ok(match dtype {
        DType::F32 => bytemuck::cast_slice(g.param::<f32>(p)?).to_vec(),
        _ => bytemuck::cast_slice(g.param::<f64>(p)?).to_vec(),
    })
}

/// The old shard files, read when first needed.
struct ShardFiles<'a> {
    dir: PathBuf,
    index: &'a Index,
    loaded: HashMap<usize, StateDict>,
}

impl ShardFiles<'_> {
    /// Copies the elements of `seg` (a parameter in this run's flat) that
    /// fall in `need` (flat coordinates) from the old checkpoint's tensor
    /// `what` into `dst`, whose element 0 is flat position `base`.
    fn copy(
        &mut self,
        seg: &super::Segment,
        old: &ParamEntry,
        need: &std::ops::Range<usize>,
        base: usize,
        what: &str,
        dst: &mut Vals,
    ) -> Result<(), String> {
        let from = need.start.max(seg.offset);
        let to = need.end.min(seg.offset + seg.numel);
        let index = self.index;
        let old_len = index.flats[old.flat].shard_len;
        let size = dst.dtype().size_bytes();
        let mut pos = from;
        while pos < to {
            let old_pos = old.offset + (pos - seg.offset);
            let (k, within) = (old_pos / old_len, old_pos % old_len);
            let run = (to - pos).min(old_len - within);
            let name = format!("flat{}.{what}", old.flat);
            let sd = self.file(k)?;
            let t = sd
                .tensors
                .get(&name)
                .ok_or_else(|| format!("shard file {} has no tensor {name}", index.files[k]))?;
            let bytes = t
                .data
                .get(within * size..(within + run) * size)
                .ok_or_else(|| format!("tensor {name} of {} is too short", index.files[k]))?;
            dst.copy_from_bytes(pos - base, bytes);
            pos += run;
        }
        Ok(())
    }

    /// Old shard file `k`.
    fn file(&mut self, k: usize) -> Result<&StateDict, String> {
        if !self.loaded.contains_key(&k) {
            let name = self
                .index
                .files
                .get(k)
                .ok_or_else(|| format!("the index lists no shard file {k}"))?;
            let (sd, _) = load_safetensors(self.dir.join(name)).map_err(|e| e.to_string())?;
            self.loaded.insert(k, sd);
        }
        Ok(&self.loaded[&k])
    }
}

/// Removes shard files of earlier saves that the new index does not name.
fn remove_stale(dir: &Path, keep: &[String]) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("shard-") && name.ends_with(".safetensors") && !keep.contains(&name) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}
