//! torch's remaining collective API on [`ProcessGroup`], built from the
//! backend's collectives: object collectives for any serde type
//! (`broadcast_object`, `all_gather_object`, `gather_object`,
//! `scatter_object`), `all_gather` into one buffer per rank and its uneven
//! form `all_gather_v`, and `monitored_barrier`, which names the ranks that
//! did not arrive.
//!
//! This module owns the encodings only: objects are postcard (serde's
//! compact binary form, which keeps every f32/f64 bit, NaN included; torch
//! pickles), sizes travel first as i64, payloads are padded to the
//! largest, as in `distributed_c10d.py`. A rank that cannot encode its
//! object still sends its size, as -1, so that every rank fails at once
//! with the same cause instead of waiting out the timeout. Every call is a
//! fixed sequence of ordinary collectives, so every rank must make it, in
//! the same order, as any collective.

use std::time::Duration;

use serde::{Serialize, de::DeserializeOwned};

use crate::{Buffer, BufferMut, CallOptions, CommError, Element, ProcessGroup, Result, validate};

/// An object's bytes.
fn encode<T: Serialize>(obj: &T) -> Result<Vec<u8>> {
    let bytes = postcard::to_allocvec(obj).map_err(|e| {
        CommError::invalid(format!(
            "the object cannot be encoded for a collective: {e}"
        ))
    })?;
    if bytes.len() > MAX_OBJECT_BYTES {
        return Err(CommError::invalid(format!(
            "the object encodes to {} bytes, over the {MAX_OBJECT_BYTES}-byte limit of object \
             collectives; send large data as tensors",
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// An object from `bytes`, sent by `rank`: every byte must be used.
fn decode<T: DeserializeOwned>(bytes: &[u8], rank: usize) -> Result<T> {
    let bad = |why: String| {
        CommError::invalid(format!(
            "rank {rank}'s object does not decode as {}: {why}; every rank must pass the same \
             type to an object collective",
            std::any::type_name::<T>()
        ))
    };
    match postcard::take_from_bytes(bytes) {
        Ok((v, [])) => Ok(v),
        Ok((_, rest)) => Err(bad(format!("{} bytes left over", rest.len()))),
        Err(e) => Err(bad(e.to_string())),
    }
}

/// The size a rank announces: its encoding's length, or -1 when it could
/// not encode (its peers then fail too, naming it).
fn announced(enc: &Result<Vec<u8>>) -> i64 {
    enc.as_ref().map_or(-1, |b| b.len() as i64)
}

/// The largest encoded object (1 GiB): object collectives carry metadata;
/// tensors travel through the tensor collectives.
const MAX_OBJECT_BYTES: usize = 1 << 30;

/// A size received from a peer, checked before it sizes an allocation.
fn checked_size(n: i64, rank: usize) -> Result<usize> {
    if n == -1 {
        return Err(CommError::invalid(format!(
            "rank {rank} could not encode its object for this collective (its own error says why)"
        )));
    }
    usize::try_from(n)
        .ok()
        .filter(|&n| n <= MAX_OBJECT_BYTES)
        .ok_or_else(|| {
            CommError::protocol(
                Some(rank),
                format!(
                    "object size {n} from rank {rank} is negative or over {MAX_OBJECT_BYTES} bytes"
                ),
            )
        })
}

impl ProcessGroup {
    /// torch's `broadcast_object_list` for one object: `root` passes
    /// `Some(&obj)`, every other rank `None`; every rank gets `root`'s
    /// object.
    pub async fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        obj: Option<&T>,
        root: usize,
    ) -> Result<T> {
        self.own_calls("broadcast_object")?;
        validate::root(root, self.world_size())?;
        validate::root_only(
            "broadcast_object",
            "an object",
            obj.is_some(),
            self.rank(),
            root,
        )?;
        let enc = obj.map(encode).unwrap_or(Ok(Vec::new()));
        let mut size = [announced(&enc)];
        self.broadcast(&mut size, root).await?;
        let mine = enc?;
        let mut bytes = if self.rank() == root {
            mine
        } else {
            vec![0u8; checked_size(size[0], root)?]
        };
        self.broadcast(&mut bytes, root).await?;
        decode(&bytes, root)
    }

    /// torch's `all_gather_object`: every rank's object, in rank order.
    pub async fn all_gather_object<T: Serialize + DeserializeOwned>(
        &self,
        obj: &T,
    ) -> Result<Vec<T>> {
        self.own_calls("all_gather_object")?;
        let enc = encode(obj);
        let sizes = self.all_gather_vec(&[announced(&enc)]).await?;
        let counts: Vec<usize> = sizes
            .iter()
            .enumerate()
            .map(|(r, &s)| checked_size(s, r))
            .collect::<Result<_>>()?;
        let parts = self.all_gather_v(&enc?, &counts).await?;
        parts
            .iter()
            .enumerate()
            .map(|(r, b)| decode(b, r))
            .collect()
    }

    /// torch's `gather_object`: `dst` gets every rank's object in rank
    /// order (`Some`), the others `None`.
    pub async fn gather_object<T: Serialize + DeserializeOwned>(
        &self,
        obj: &T,
        dst: usize,
    ) -> Result<Option<Vec<T>>> {
        self.own_calls("gather_object")?;
        validate::root(dst, self.world_size())?;
        let enc = encode(obj);
        let sizes = self.all_gather_vec(&[announced(&enc)]).await?;
        let width = self.padded_width(&sizes)?;
        let mut padded = enc?;
        padded.resize(width, 0);
        let n = self.world_size();
        let mut all = (self.rank() == dst).then(|| vec![0u8; width * n]);
        self.gather(all.as_deref_mut(), &padded, dst).await?;
        let Some(all) = all else {
            return Ok(None);
        };
        (0..n)
            .map(|r| {
                let len = checked_size(sizes[r], r)?;
                decode(&all[r * width..r * width + len], r)
            })
            .collect::<Result<Vec<T>>>()
            .map(Some)
    }

    /// torch's `scatter_object_list`: `src` passes one object per rank
    /// (`Some`), the others `None`; rank `r` gets object `r`.
    pub async fn scatter_object<T: Serialize + DeserializeOwned>(
        &self,
        objs: Option<&[T]>,
        src: usize,
    ) -> Result<T> {
        self.own_calls("scatter_object")?;
        let n = self.world_size();
        validate::root(src, n)?;
        validate::root_only(
            "scatter_object",
            "the objects",
            objs.is_some(),
            self.rank(),
            src,
        )?;
        // On src, any local failure is announced as width -1, so that
        // every rank fails now rather than at its timeout.
        let prepared: Result<Vec<Vec<u8>>> = match objs {
            Some(o) if o.len() != n => Err(CommError::invalid(format!(
                "scatter_object needs one object per rank: {} given for a world of {n}",
                o.len()
            ))),
            Some(o) => o.iter().map(encode).collect(),
            None => Ok(Vec::new()),
        };
        let sizes: Vec<i64> = prepared
            .as_ref()
            .map(|e| e.iter().map(|b| b.len() as i64).collect())
            .unwrap_or_default();
        let mut width = [match &prepared {
            Ok(_) => sizes.iter().copied().max().unwrap_or(0),
            Err(_) => -1,
        }];
        self.broadcast(&mut width, src).await?;
        let encoded = prepared?;
        let width = checked_size(width[0], src)?;
        let flat: Vec<u8> = encoded
            .into_iter()
            .flat_map(|mut b| {
                b.resize(width, 0);
                b
            })
            .collect();
        let mut size = [0i64];
        self.scatter(&mut size, objs.map(|_| &sizes[..]), src)
            .await?;
        let mut mine = vec![0u8; width];
        self.scatter(&mut mine, objs.map(|_| &flat[..]), src)
            .await?;
        let len = checked_size(size[0], src)?.min(width);
        decode(&mine[..len], src)
    }

    /// The padded width for `sizes` (their largest), checked.
    fn padded_width(&self, sizes: &[i64]) -> Result<usize> {
        let mut width = 0;
        for (r, &s) in sizes.iter().enumerate() {
            width = width.max(checked_size(s, r)?);
        }
        Ok(width)
    }

    /// Uneven `all_gather` (torch's `all_gather` into tensors of different
    /// sizes): rank `r` contributes `input`, whose length every rank passes
    /// as `counts[r]`; returns each rank's part. Parts are padded to the
    /// largest for the wire.
    pub async fn all_gather_v<T: Element>(
        &self,
        input: &[T],
        counts: &[usize],
    ) -> Result<Vec<Vec<T>>> {
        let n = self.world_size();
        if counts.len() != n {
            return Err(CommError::invalid(format!(
                "all_gather_v needs one count per rank: {} given for a world of {n}",
                counts.len()
            )));
        }
        if counts[self.rank()] != input.len() {
            return Err(CommError::invalid(format!(
                "all_gather_v: this rank's count is {} but its input has {} elements",
                counts[self.rank()],
                input.len()
            )));
        }
        let width = counts.iter().copied().max().unwrap_or(0);
        let mut padded = input.to_vec();
        padded.resize(width, T::zeroed());
        let all = self.all_gather_vec(&padded).await?;
        Ok((0..n)
            .map(|r| all[r * width..r * width + counts[r]].to_vec())
            .collect())
    }

    /// `all_gather` into one buffer per rank (torch's list form):
    /// `outputs[r]` receives rank `r`'s `input`; every buffer has
    /// `input.len()` elements.
    pub async fn all_gather_into<T: Element>(
        &self,
        outputs: &mut [&mut [T]],
        input: &[T],
    ) -> Result<()> {
        let n = self.world_size();
        if outputs.len() != n || outputs.iter().any(|o| o.len() != input.len()) {
            return Err(CommError::invalid(format!(
                "all_gather into a list needs {n} buffers of {} elements (one per rank), got {} \
                 buffers of lengths {:?}",
                input.len(),
                outputs.len(),
                outputs.iter().map(|o| o.len()).collect::<Vec<_>>()
            )));
        }
        let all = self.all_gather_vec(input).await?;
        for (o, part) in outputs.iter_mut().zip(all.chunks(input.len().max(1))) {
            o.copy_from_slice(&part[..o.len()]);
        }
        Ok(())
    }

    /// torch's `monitored_barrier`: a barrier that, when ranks do not
    /// arrive within `timeout`, fails on rank 0 with a `Timeout` naming
    /// them ("[rank 0, barrier, seq 7] timed out after 30s waiting for ranks
    /// [2, 5]"); the others then fail too (the failure is sticky and
    /// propagates). Every rank sends a token to rank 0 (a gather), then rank
    /// 0 releases them (a broadcast).
    pub async fn monitored_barrier(&self, timeout: Duration) -> Result<()> {
        let n = self.world_size();
        let opts = CallOptions::root(0).with_timeout(timeout);
        let token = [1u8];
        let mut arrived = (self.rank() == 0).then(|| vec![0u8; n]);
        let gathered = self
            .backend()
            .gather(
                arrived.as_deref_mut().map(BufferMut::from),
                Buffer::from(&token[..]),
                &opts,
            )
            .await;
        if let Err(CommError::Timeout {
            ctx, waiting_on, ..
        }) = &gathered
            && self.rank() == 0
        {
            // The ranks rank 0 still waits for are the ones that did not
            // arrive: say so as this barrier's timeout.
            return Err(CommError::Timeout {
                ctx: crate::ErrorContext {
                    op: Some(crate::OpKind::Barrier),
                    ..*ctx
                },
                after: timeout,
                waiting_on: waiting_on.clone(),
            });
        }
        gathered?;
        // Released together, each rank by rank 0 itself (a scatter is
        // direct: no rank waits on a tree parent that is not rank 0).
        let mut go = [0u8];
        let release = vec![1u8; n];
        self.backend()
            .scatter(
                BufferMut::from(&mut go[..]),
                (self.rank() == 0).then(|| Buffer::from(&release[..])),
                &opts,
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_from_peers_are_checked_before_they_size_anything() {
        assert_eq!(checked_size(5, 0).unwrap(), 5);
        assert!(
            checked_size(-1, 2)
                .unwrap_err()
                .to_string()
                .contains("rank 2")
        );
        assert!(checked_size(i64::MAX, 1).is_err());
        let e = decode::<Vec<u32>>(&[9, 1], 3).unwrap_err().to_string();
        assert!(e.contains("rank 3") && e.contains("same type"), "{e}");
        assert!(
            checked_size(-1, 4)
                .unwrap_err()
                .to_string()
                .contains("rank 4 could not encode")
        );
        // Every float bit survives, NaN and infinities included.
        let v = (f64::NAN, f32::INFINITY, Some(-0.0f64));
        let back: (f64, f32, Option<f64>) = decode(&encode(&v).unwrap(), 0).unwrap();
        assert!(back.0.is_nan() && back.1 == f32::INFINITY);
        assert_eq!(back.2.map(f64::to_bits), Some((-0.0f64).to_bits()));
    }
}
