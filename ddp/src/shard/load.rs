//! Loading a sharded checkpoint ([`super::save`] writes them) at any world
//! size, strategy or unit layout: every parameter is found by name in the
//! old flats, and the runs of elements this rank needs are read from the
//! old shard files, one file at a time, into fresh buffers that replace
//! the old ones only once every rank has loaded.

use std::{
    collections::{BTreeMap, HashMap},
    ops::Range,
    path::Path,
    sync::Arc,
};

use super::{
    Segment, Sharded, Vals,
    save::{FORMAT, Index, ParamEntry},
};
use crate::{checkpoint::load_safetensors, error::DdpError};

/// Elements to copy from one old shard file.
#[derive(Debug)]
struct Run {
    /// The tensor in the old file (`flat3.param`, `flat3.state1`).
    tensor: String,
    /// First element there.
    from: usize,
    /// Elements.
    len: usize,
    /// Where they go: this rank's flat, `None` for the parameters or the
    /// state slot, and the element in that buffer.
    flat: usize,
    slot: Option<usize>,
    to: usize,
}

/// This rank's new buffers, filled from the checkpoint.
struct Fresh {
    params: Vec<Vals>,
    state: Vec<Vec<Vals>>,
}

impl Sharded {
    /// Loads a sharded checkpoint written at any world size and by any
    /// strategy, into this rank's part of the flat buffers: parameters,
    /// optimizer state and the step count. Returns the metadata given to
    /// [`Sharded::save_sharded`]. Every rank calls it between steps; if any
    /// rank fails, every rank keeps what it had and gets the error.
    pub async fn load_sharded(&mut self, dir: &Path) -> Result<BTreeMap<String, String>, DdpError> {
        self.enter("load_sharded")?;
        let out = self.load_inner(dir).await;
        self.leave();
        out
    }

    async fn load_inner(&mut self, dir: &Path) -> Result<BTreeMap<String, String>, DdpError> {
        self.between_steps("load_sharded")?;
        // A gather made before the load would hand out the old values.
        let left: Vec<_> = self.prefetched.drain().flat_map(|(_, c)| c).collect();
        for call in left {
            self.finish(call, "a prefetch all_gather made before the load".into())
                .await?;
        }
        let loaded = self.read_sharded(dir);
        let reason = loaded.as_ref().err().cloned().unwrap_or_default();
        let what = format!("loading the sharded checkpoint {}", dir.display());
        self.agree(&what, reason).await?;
        let Ok((index, fresh)) = loaded else {
            unreachable!("agree fails on the rank whose load failed")
        };
        for (fs, (p, st)) in self
            .flats
            .iter_mut()
            .zip(fresh.params.into_iter().zip(fresh.state))
        {
            fs.params = Arc::new(p);
            fs.state = st;
        }
        self.steps = index.steps;
        if let (Some(s), Some(state)) = (&mut self.scaler, index.loss_scale) {
            s.restore(state);
        }
        Ok(index.metadata)
    }

    /// Reads and checks the index, then fills fresh buffers.
    fn read_sharded(&self, dir: &Path) -> Result<(Index, Fresh), String> {
        let at = dir.join("index.json");
        let text = consort_comm::files::read_regular(&at, 64 << 20).map_err(|e| {
            format!(
                "cannot read {}: {e} (no complete sharded checkpoint there; save_sharded writes \
                 it last)",
                at.display()
            )
        })?;
        let index: Index = serde_json::from_slice(&text)
            .map_err(|e| format!("{} is not a sharded checkpoint index: {e}", at.display()))?;
        self.check_index(&index, &at)?;
        let copy = |e: consort_comm::CommError| format!("copying the shards to load into: {e}");
        let mut fresh = Fresh {
            params: (self.flats.iter())
                .map(|fs| fs.params.try_clone())
                .collect::<Result<_, _>>()
                .map_err(copy)?,
            state: (self.flats.iter())
                .map(|fs| fs.state.iter().map(Vals::try_clone).collect())
                .collect::<Result<_, _>>()
                .map_err(copy)?,
        };
        let mut by_file: BTreeMap<usize, Vec<Run>> = BTreeMap::new();
        for run in self.plan(&index) {
            by_file.entry(run.0).or_default().push(run.1);
        }
        for (k, runs) in by_file {
            let name = &index.files[k];
            let (sd, _) = load_safetensors(dir.join(name)).map_err(|e| e.to_string())?;
            for r in runs {
                let t = sd
                    .tensors
                    .get(&r.tensor)
                    .ok_or_else(|| format!("shard file {name} has no tensor {}", r.tensor))?;
                let dst = match r.slot {
                    None => &mut fresh.params[r.flat],
                    Some(s) => &mut fresh.state[r.flat][s],
                };
                let size = dst.dtype().size_bytes();
                // Checked: the runs come from the index, which may be crafted.
                let span = r.from.checked_mul(size).and_then(|start| {
                    let end = r.from.checked_add(r.len)?.checked_mul(size)?;
                    Some(start..end)
                });
                let bytes = span
                    .and_then(|span| t.data.get(span))
                    .filter(|_| t.dtype == dst.dtype())
                    .ok_or_else(|| {
                        format!(
                            "tensor {} of {name} is shorter than its index says",
                            r.tensor
                        )
                    })?;
                dst.copy_from_bytes(r.to, bytes).map_err(|e| {
                    format!("tensor {} of {name} does not fit its flat: {e}", r.tensor)
                })?;
            }
        }
        Ok((index, fresh))
    }

    /// Every run of elements this rank needs, with the old shard file it
    /// is in.
    fn plan(&self, index: &Index) -> Vec<(usize, Run)> {
        let by_name: HashMap<&str, &ParamEntry> =
            index.params.iter().map(|p| (p.name.as_str(), p)).collect();
        let k = self.group.index;
        let mut out = Vec::new();
        for (f, flat) in self.layout.flats.iter().enumerate() {
            let mine = flat.valid_range(k);
            let (need, base) = if self.strategy.shards_params() {
                (mine.clone(), mine.start)
            } else {
                (0..flat.numel, 0)
            };
            for seg in &flat.segments {
                let old = by_name[self.specs[seg.param].name.as_str()];
                let old_len = index.flats[old.flat].shard_len;
                let mut add = |need: &Range<usize>, base: usize, slot: Option<usize>| {
                    let tensor = match slot {
                        None => format!("flat{}.param", old.flat),
                        Some(s) => format!("flat{}.state{s}", old.flat),
                    };
                    for (file, from, len, pos) in runs(seg, old.offset, old_len, need) {
                        let to = pos - base;
                        let r = Run {
                            tensor: tensor.clone(),
                            from,
                            len,
                            flat: f,
                            slot,
                            to,
                        };
                        out.push((file, r));
                    }
                };
                add(&need, base, None);
                for s in 0..self.optimizer.slots() {
                    add(&mine, mine.start, Some(s));
                }
            }
        }
        out
    }

    /// The index fits this model and optimizer, and is consistent.
    fn check_index(&self, index: &Index, at: &Path) -> Result<(), String> {
        let at = at.display();
        if index.format != FORMAT {
            return Err(format!(
                "{at} has format {:?}; this consort reads {FORMAT:?}",
                index.format
            ));
        }
        if index.optimizer != self.optimizer.name() || index.slots != self.optimizer.slots() {
            return Err(format!(
                "{at} holds {} state ({} slot(s) per element), but this run's optimizer is {} ({} \
                 slot(s)); resume with the same optimizer",
                index.optimizer,
                index.slots,
                self.optimizer.name(),
                self.optimizer.slots()
            ));
        }
        if index.files.len() != index.shards || index.shards == 0 {
            return Err(format!(
                "{at}: {} shard files for {} shards",
                index.files.len(),
                index.shards
            ));
        }
        if let Some(bad) = index.files.iter().find(|f| !plain_file_name(f)) {
            return Err(format!(
                "{at} names the shard file {bad:?}, which is not a plain file name in the \
                 checkpoint's directory: the index is damaged or crafted"
            ));
        }
        if index.params.len() != self.specs.len() {
            return Err(format!(
                "{at} holds {} parameters, this model {}; is it this model's?",
                index.params.len(),
                self.specs.len()
            ));
        }
        let theirs: HashMap<&str, &ParamEntry> =
            index.params.iter().map(|p| (p.name.as_str(), p)).collect();
        for s in &self.specs {
            let Some(p) = theirs.get(s.name.as_str()) else {
                return Err(format!(
                    "{at} has no parameter {}; is it this model's?",
                    s.name
                ));
            };
            if p.dtype != s.dtype.name() || p.shape != s.shape {
                return Err(format!(
                    "{at}: parameter {} is {} {:?} there but {} here",
                    s.name,
                    p.dtype,
                    p.shape,
                    s.describe()
                ));
            }
            let fits = index.flats.get(p.flat).is_some_and(|f| {
                f.dtype == p.dtype
                    && p.offset
                        .checked_add(s.numel())
                        .is_some_and(|end| end <= f.numel)
                    && f.shard_len
                        .checked_mul(index.shards)
                        .is_some_and(|n| n >= f.numel)
            });
            if !fits {
                return Err(format!(
                    "{at}: parameter {}'s place (flat {}, offset {}) does not fit its flats: the \
                     index is damaged",
                    s.name, p.flat, p.offset
                ));
            }
        }
        Ok(())
    }
}

/// Whether `name` is one plain file name (no directory, no `..`, not
/// absolute): what `save_sharded` writes, and all a load may open.
fn plain_file_name(name: &str) -> bool {
    let mut parts = Path::new(name).components();
    matches!(
        (parts.next(), parts.next()),
        (Some(std::path::Component::Normal(n)), None) if n == name
    )
}

/// The runs of `seg`'s elements that fall in `need` (flat coordinates of
/// this run's flat), as (old shard file, first element in that file's
/// tensor, length, position in this run's flat). The parameter starts at
/// `old_offset` in an old flat of `old_len`-element shards.
fn runs(
    seg: &Segment,
    old_offset: usize,
    old_len: usize,
    need: &Range<usize>,
) -> Vec<(usize, usize, usize, usize)> {
    let from = need.start.max(seg.offset);
    let to = need.end.min(seg.offset + seg.numel);
    let mut out = Vec::new();
    let mut pos = from;
    while pos < to {
        let old_pos = old_offset + (pos - seg.offset);
        let (k, within) = (old_pos / old_len, old_pos % old_len);
        let len = (to - pos).min(old_len - within);
        out.push((k, within, len, pos));
        pos += len;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::plain_file_name;

    #[test]
    fn only_plain_file_names_may_be_opened() {
        assert!(plain_file_name("shard-00001-of-00002.safetensors"));
        for bad in ["", ".", "..", "../x", "/etc/passwd", "a/b", "./a", "a/"] {
            assert!(!plain_file_name(bad), "{bad:?}");
        }
    }
}
