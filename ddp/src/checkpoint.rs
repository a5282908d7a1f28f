//! safetensors checkpoints, written so that a crash never leaves a torn
//! file.
//!
//! The format (as Python's `safetensors` reads it): an 8-byte
//! little-endian header length, a JSON header mapping each name to its
//! `dtype`, `shape` and `data_offsets` (plus an optional `__metadata__`
//! map of strings), padded with spaces to a multiple of 8, then the
//! tensors' bytes back to back in header order, little-endian.
//!
//! [`save_safetensors`] writes to a temporary file beside the target,
//! fsyncs it, renames it over the target and fsyncs the directory: a
//! reader sees the old checkpoint or the new one, never half of one.
//! [`load_safetensors`] checks every offset and length before it trusts
//! them.

use std::{
    collections::BTreeMap,
    io::Write,
    path::{Path, PathBuf},
};

use consort_comm::DType;
use serde_json::{Map, Value, json};

use crate::state_dict::StateDict;
pub use crate::{error::CheckpointError, tensor::Tensor};

/// safetensors' name for a dtype.
fn st_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "F32",
        DType::F64 => "F64",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::I8 => "I8",
        DType::U8 => "U8",
        DType::I32 => "I32",
        DType::I64 => "I64",
        DType::U32 => "U32",
        DType::U64 => "U64",
    }
}

fn from_st_name(s: &str) -> Option<DType> {
    DType::ALL.into_iter().find(|d| st_name(*d) == s)
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.to_path_buf();
    move |source| CheckpointError::Io { what, path, source }
}

/// Serialises `sd` (with optional string `metadata`) in safetensors form.
pub fn to_safetensors_bytes(sd: &StateDict, metadata: &BTreeMap<String, String>) -> Vec<u8> {
    let mut header = Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), json!(metadata));
    }
    let mut offset = 0usize;
    for (name, t) in &sd.tensors {
        header.insert(
            name.clone(),
            json!({"dtype": st_name(t.dtype), "shape": t.shape, "data_offsets": [offset, offset + t.data.len()]}),
        );
        offset += t.data.len();
    }
    let mut head = Value::Object(header).to_string().into_bytes();
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + head.len() + offset);
    out.extend_from_slice(&(head.len() as u64).to_le_bytes());
    out.extend_from_slice(&head);
    for t in sd.tensors.values() {
        out.extend_from_slice(&t.data);
    }
    out
}

/// Writes `sd` to `path` atomically: a temporary file in the same
/// directory, fsync, rename over `path`, fsync the directory.
pub fn save_safetensors(
    path: impl AsRef<Path>,
    sd: &StateDict,
    metadata: &BTreeMap<String, String>,
) -> Result<(), CheckpointError> {
    write_atomic(path.as_ref(), &to_safetensors_bytes(sd, metadata))
}

/// Writes `bytes` to `path` atomically: a temporary file in the same
/// directory, fsync, rename over `path`, fsync the directory. A reader sees
/// the old file or the new one, never a part.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| CheckpointError::Format {
            path: path.to_path_buf(),
            reason: "the path names no file".into(),
        })?
        .to_string_lossy()
        .into_owned();
    let tmp = dir.join(format!(".{file_name}.tmp-{}", std::process::id()));
    let write = || -> Result<(), CheckpointError> {
        // New, and never through a planted symbolic link.
        let mut f = consort_comm::files::create_new(&tmp).map_err(io("creating", &tmp))?;
        f.write_all(bytes).map_err(io("writing", &tmp))?;
        f.sync_all().map_err(io("syncing", &tmp))?;
        std::fs::rename(&tmp, path).map_err(io("renaming the finished file onto", path))?;
        if let Ok(d) = std::fs::File::open(&dir) {
            // Makes the rename itself durable; not every filesystem allows
            // fsync on a directory, so a failure here is not an error.
            let _ = d.sync_all();
        }
        Ok(())
    };
    let result = write();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The largest safetensors file [`load_safetensors`] reads: 1 TiB.
pub const MAX_CHECKPOINT: u64 = 1 << 40;

/// Reads a safetensors file: its tensors and its `__metadata__`.
pub fn load_safetensors(
    path: impl AsRef<Path>,
) -> Result<(StateDict, BTreeMap<String, String>), CheckpointError> {
    let path = path.as_ref();
    // A regular file only, read with a bound: a link to /dev/zero or a
    // FIFO is an error, not a hang.
    let bytes =
        consort_comm::files::read_regular(path, MAX_CHECKPOINT).map_err(io("reading", path))?;
    from_safetensors_bytes(&bytes).map_err(|reason| CheckpointError::Format {
        path: path.to_path_buf(),
        reason,
    })
}

/// Parses safetensors bytes; every length and offset is checked.
pub fn from_safetensors_bytes(
    bytes: &[u8],
) -> Result<(StateDict, BTreeMap<String, String>), String> {
    let len_bytes: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or("shorter than the 8-byte header length")?;
    let n = u64::from_le_bytes(len_bytes);
    let end = usize::try_from(n)
        .ok()
        .and_then(|n| n.checked_add(8))
        .filter(|e| *e <= bytes.len())
        .ok_or_else(|| {
            format!(
                "header length {n} runs past the end of the file ({} bytes)",
                bytes.len()
            )
        })?;
    let header: Map<String, Value> = serde_json::from_slice(&bytes[8..end])
        .map_err(|e| format!("the header is not a JSON object: {e}"))?;
    let data = &bytes[end..];
    let mut sd = StateDict::new();
    let mut metadata = BTreeMap::new();
    for (name, v) in header {
        if name == "__metadata__" {
            let m = v.as_object().ok_or("__metadata__ is not an object")?;
            for (k, v) in m {
                let s = v
                    .as_str()
                    .ok_or_else(|| format!("__metadata__[{k:?}] is not a string"))?;
                metadata.insert(k.clone(), s.to_string());
            }
            continue;
        }
        let bad = |what: &str| format!("tensor {name:?}: {what}");
        let dtype = v["dtype"]
            .as_str()
            .and_then(from_st_name)
            .ok_or_else(|| bad(&format!("unsupported dtype {}", v["dtype"])))?;
        let shape: Vec<usize> = v["shape"]
            .as_array()
            .ok_or_else(|| bad("no shape"))?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("shape is not a list of sizes"))?;
        let offs: Vec<usize> = v["data_offsets"]
            .as_array()
            .filter(|a| a.len() == 2)
            .and_then(|a| {
                a.iter()
                    .map(|o| o.as_u64().and_then(|o| usize::try_from(o).ok()))
                    .collect()
            })
            .ok_or_else(|| bad("data_offsets is not [begin, end]"))?;
        let raw = data.get(offs[0]..offs[1]).ok_or_else(|| {
            bad(&format!(
                "data_offsets {offs:?} fall outside the {} data bytes",
                data.len()
            ))
        })?;
        let t = Tensor::new(dtype, shape, raw.to_vec()).map_err(|e| bad(&e.to_string()))?;
        sd.insert(name, t);
    }
    Ok((sd, metadata))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> StateDict {
        let mut sd = StateDict::new();
        sd.insert(
            "fc.weight",
            Tensor::from_slice::<f32>(vec![2, 3], &[1., 2., 3., 4., 5., 6.]).unwrap(),
        );
        sd.insert("fc.bias", Tensor::from_slice(vec![2], &[7i64, -8]).unwrap());
        sd.insert(
            "scale",
            Tensor::from_slice(vec![], &[consort_comm::half::f16::from_f32(0.5)]).unwrap(),
        );
        sd
    }

    #[test]
    fn save_then_load_round_trips_with_metadata() {
        let dir = std::env::temp_dir().join(format!("consort-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.safetensors");
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        save_safetensors(&path, &sample(), &meta).unwrap();
        let (sd, m) = load_safetensors(&path).unwrap();
        assert_eq!(sd, sample());
        assert_eq!(m, meta);
        assert_eq!(sd.tensors["fc.bias"].to_vec::<i64>(), Some(vec![7, -8]));
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["model.safetensors"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_save_leaves_the_old_checkpoint_whole() {
        let dir = std::env::temp_dir().join(format!("consort-ckpt-torn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.safetensors");
        save_safetensors(&path, &sample(), &BTreeMap::new()).unwrap();
        let before = std::fs::read(&path).unwrap();
        // A directory where the temporary file would go makes the write
        // fail midway; the checkpoint that was there must be untouched.
        std::fs::create_dir(dir.join(format!(".model.safetensors.tmp-{}", std::process::id())))
            .unwrap();
        let mut bigger = sample();
        bigger.insert("extra", Tensor::from_slice::<f32>(vec![1], &[9.0]).unwrap());
        assert!(save_safetensors(&path, &bigger, &BTreeMap::new()).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), before);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn header_is_padded_and_offsets_are_contiguous() {
        let bytes = to_safetensors_bytes(&sample(), &BTreeMap::new());
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        let h: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        assert_eq!(h["fc.bias"]["data_offsets"], json!([0, 16]));
        assert_eq!(h["fc.weight"]["data_offsets"], json!([16, 40]));
        assert_eq!(
            h["scale"],
            json!({"dtype": "F16", "shape": [], "data_offsets": [40, 42]})
        );
        assert_eq!(bytes.len(), 8 + n + 42);
    }

    proptest! {
        /// Truncations and bit flips give an error or a valid state dict,
        /// never a panic.
        #[test]
        fn malformed_files_are_errors(cut in 0usize..200, flip in 0usize..200, bit in 0u8..8) {
            let mut bytes = to_safetensors_bytes(&sample(), &BTreeMap::new());
            if flip < bytes.len() {
                bytes[flip] ^= 1 << bit;
            }
            bytes.truncate(cut);
            let _ = from_safetensors_bytes(&bytes);
        }
    }
}
