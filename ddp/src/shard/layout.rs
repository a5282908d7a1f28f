//! How the sharded strategies lay parameters out: wrapping units, each
//! flattened into one buffer per dtype (parameters in registration order),
//! padded to a multiple of the shard count and cut into equal contiguous
//! shards, as ZeRO and FSDP's flat parameters are. Pure: no memory, no
//! calls.

use std::ops::Range;

use consort_comm::DType;

use crate::params::ParamSpec;

/// One parameter's place in its flat buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// The parameter's index in registration order.
    pub param: usize,
    /// Its first element in the flat buffer.
    pub offset: usize,
    /// Its element count.
    pub numel: usize,
}

/// One unit's parameters of one dtype, concatenated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flat {
    /// The wrapping unit it belongs to.
    pub unit: usize,
    /// The element type.
    pub dtype: DType,
    /// Its parameters, in registration order.
    pub segments: Vec<Segment>,
    /// Elements, without padding.
    pub numel: usize,
    /// Elements per shard: `ceil(numel / shards)`.
    pub shard_len: usize,
}

impl Flat {
    /// Elements with padding: `shard_len * shards`.
    pub fn padded(&self, shards: usize) -> usize {
        self.shard_len * shards
    }

    /// Shard `k`'s elements, in padded coordinates.
    pub fn shard_range(&self, k: usize) -> Range<usize> {
        k * self.shard_len..(k + 1) * self.shard_len
    }

    /// The real (unpadded) elements of shard `k`, in flat coordinates.
    pub fn valid_range(&self, k: usize) -> Range<usize> {
        let r = self.shard_range(k);
        r.start.min(self.numel)..r.end.min(self.numel)
    }
}

/// Every unit's flats, and where each parameter lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The flats, unit by unit (one per dtype present in the unit).
    pub flats: Vec<Flat>,
    /// Each unit's flats, as indices into `flats`.
    pub unit_flats: Vec<Vec<usize>>,
    /// Each unit's parameters, in registration order.
    pub units: Vec<Vec<usize>>,
    /// Each parameter's (flat, segment index).
    pub place: Vec<(usize, usize)>,
    /// How many shards each flat is cut into.
    pub shards: usize,
}

/// Consecutive parameters, in registration order, grouped into units of
/// up to `cap` bytes (a unit holds at least one parameter).
pub fn units_by_cap(specs: &[ParamSpec], cap: usize) -> Vec<Vec<usize>> {
    let mut units: Vec<Vec<usize>> = Vec::new();
    let mut bytes = 0;
    for (i, s) in specs.iter().enumerate() {
        match units.last_mut() {
            Some(u) if bytes + s.bytes() <= cap => u.push(i),
            _ => {
                units.push(vec![i]);
                bytes = 0;
            }
        }
        bytes += s.bytes();
    }
    units
}

impl Layout {
    /// The layout of `specs` in `units`, cut into `shards`. Every
    /// parameter must be in exactly one unit.
    pub fn new(specs: &[ParamSpec], units: &[Vec<usize>], shards: usize) -> Result<Self, String> {
        if shards == 0 {
            return Err("the shard count must be at least 1".into());
        }
        let mut place = vec![None; specs.len()];
        let mut flats: Vec<Flat> = Vec::new();
        let mut unit_flats = Vec::with_capacity(units.len());
        for (u, members) in units.iter().enumerate() {
            if members.is_empty() {
                return Err(format!("wrapping unit {u} holds no parameter"));
            }
            let first = flats.len();
            for &p in members {
                let spec = specs.get(p).ok_or_else(|| {
                    format!(
                        "wrapping unit {u} names parameter {p}, but the model has {}",
                        specs.len()
                    )
                })?;
                if place[p].is_some() {
                    return Err(format!(
                        "parameter {p} ({}) is in more than one wrapping unit",
                        spec.name
                    ));
                }
                let f = match flats[first..].iter().position(|f| f.dtype == spec.dtype) {
                    Some(k) => first + k,
                    None => {
                        flats.push(Flat {
                            unit: u,
                            dtype: spec.dtype,
                            segments: Vec::new(),
                            numel: 0,
                            shard_len: 0,
                        });
                        flats.len() - 1
                    }
                };
                let flat = &mut flats[f];
                place[p] = Some((f, flat.segments.len()));
                flat.segments.push(Segment {
                    param: p,
                    offset: flat.numel,
                    numel: spec.numel(),
                });
                flat.numel += spec.numel();
            }
            unit_flats.push((first..flats.len()).collect());
        }
        for f in &mut flats {
            f.shard_len = f.numel.div_ceil(shards);
        }
        let place = place
            .into_iter()
            .enumerate()
            .map(|(p, at)| {
                at.ok_or_else(|| {
                    format!(
                        "parameter {p} ({}) is in no wrapping unit; every parameter must be in one",
                        specs[p].name
                    )
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Layout {
            flats,
            unit_flats,
            units: units.to_vec(),
            place,
            shards,
        })
    }

    /// Parameter `p`'s flat and its element range there.
    pub fn range_of(&self, p: usize) -> (usize, Range<usize>) {
        let (f, s) = self.place[p];
        let seg = self.flats[f].segments[s];
        (f, seg.offset..seg.offset + seg.numel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(i: usize, n: usize, dtype: DType) -> ParamSpec {
        ParamSpec {
            name: format!("p{i}"),
            dtype,
            shape: vec![n],
        }
    }

    proptest! {
        /// Shards tile each flat exactly once, the padding is under one
        /// element per shard, and every parameter sits whole in one flat.
        #[test]
        fn shards_tile_every_flat(
            sizes in prop::collection::vec((0usize..40, any::<bool>()), 1..12),
            shards in 1usize..9,
            cap in 1usize..400,
        ) {
            let specs: Vec<ParamSpec> = sizes
                .iter()
                .enumerate()
                .map(|(i, &(n, f64))| spec(i, n, if f64 { DType::F64 } else { DType::F32 }))
                .collect();
            let units = units_by_cap(&specs, cap);
            let l = Layout::new(&specs, &units, shards).unwrap();
            for f in &l.flats {
                prop_assert!(f.padded(shards) >= f.numel);
                prop_assert!(f.padded(shards) - f.numel < shards.max(1) || f.numel == 0);
                let covered: usize = (0..shards).map(|k| f.valid_range(k).len()).sum();
                prop_assert_eq!(covered, f.numel);
                prop_assert!(f.segments.iter().all(|s| specs[s.param].dtype == f.dtype));
            }
            let mut seen = 0;
            for (p, s) in specs.iter().enumerate() {
                let (f, r) = l.range_of(p);
                prop_assert_eq!(r.len(), s.numel());
                prop_assert!(r.end <= l.flats[f].numel);
                prop_assert!(l.units[l.flats[f].unit].contains(&p));
                seen += 1;
            }
            prop_assert_eq!(seen, specs.len());
        }
    }

    #[test]
    fn a_parameter_in_no_unit_or_two_is_named() {
        let specs = vec![spec(0, 3, DType::F32), spec(1, 2, DType::F32)];
        let e = Layout::new(&specs, &[vec![0]], 2).unwrap_err();
        assert!(e.contains("p1") && e.contains("no wrapping unit"), "{e}");
        let e = Layout::new(&specs, &[vec![0, 1], vec![1]], 2).unwrap_err();
        assert!(e.contains("more than one"), "{e}");
        let e = Layout::new(&specs, &[vec![0, 1, 5]], 2).unwrap_err();
        assert!(e.contains("names parameter 5"), "{e}");
    }
}
