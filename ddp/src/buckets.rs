//! Gradient bucket assignment, as c10d's
//! `compute_bucket_assignment_by_size` does it.
//!
//! Parameters are grouped by (dtype, device). Each group fills one open
//! bucket at a time, in the order given (DDP passes the reverse of the
//! parameter order, roughly the order gradients become ready). A bucket
//! closes as soon as its bytes reach the current limit, so it overshoots
//! by at most one tensor. Each group walks its own list of limits and
//! stays on the last one: DDP's default is `[1 MiB, 25 MiB]` (a small first
//! bucket starts communication early), and a user-set cap is used alone.
//! With no explicit order, buckets are sorted by their smallest parameter
//! index, as c10d does.

use consort_comm::DType;

/// c10d's default `bucket_cap_mb` (25 MiB).
pub const DEFAULT_BUCKET_CAP: usize = 25 * 1024 * 1024;
/// The first bucket's cap when the cap is left at its default (1 MiB).
pub const FIRST_BUCKET_CAP: usize = 1024 * 1024;

/// What bucketing needs to know about one parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ParamInfo {
    /// Element type of its gradient.
    pub dtype: DType,
    /// Device index (`-1` for host memory).
    pub device: i32,
    /// Number of elements.
    pub numel: usize,
}

impl ParamInfo {
    /// Bytes of its gradient.
    pub fn bytes(&self) -> usize {
        self.numel.saturating_mul(self.dtype.size_bytes())
    }
}

/// DDP's bucket size limits: `[1 MiB, 25 MiB]` by default, or the one cap
/// the user set (`bucket_cap_mb`).
pub fn bucket_limits(cap: Option<usize>) -> Vec<usize> {
    match cap {
        None => vec![FIRST_BUCKET_CAP, DEFAULT_BUCKET_CAP],
        Some(c) => vec![c],
    }
}

/// Why an assignment could not be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BucketError {
    /// No size limit was given.
    #[error("bucket size limits are empty: pass at least one cap, e.g. bucket_limits(None)")]
    NoLimits,
    /// `order` is not a permutation of the parameter indices.
    #[error(
        "the parameter order must name each of the {params} parameters exactly once; \
         index {index} is {problem}"
    )]
    BadOrder {
        /// Number of parameters.
        params: usize,
        /// The offending index.
        index: usize,
        /// "out of range", "repeated" or "missing".
        problem: &'static str,
    },
}

/// Assigns parameters to buckets. `order` is the order to fill them in
/// (DDP: reversed parameter order, or the order gradients became ready
/// after the first iteration); `None` means `0..n`, and then buckets are
/// sorted by their smallest index. Returns each bucket's parameter
/// indices, in launch order.
pub fn assign_buckets(
    params: &[ParamInfo],
    limits: &[usize],
    order: Option<&[usize]>,
) -> Result<Vec<Vec<usize>>, BucketError> {
    if limits.is_empty() {
        return Err(BucketError::NoLimits);
    }
    let identity: Vec<usize>;
    let walk: &[usize] = match order {
        Some(o) => {
            let mut seen = vec![false; params.len()];
            for &i in o {
                let problem = match seen.get(i) {
                    None => "out of range",
                    Some(true) => "repeated",
                    Some(false) => {
                        seen[i] = true;
                        continue;
                    }
                };
                return Err(BucketError::BadOrder {
                    params: params.len(),
                    index: i,
                    problem,
                });
            }
            if let Some(i) = seen.iter().position(|s| !s) {
                return Err(BucketError::BadOrder {
                    params: params.len(),
                    index: i,
                    problem: "missing",
                });
            }
            o
        }
        None => {
            identity = (0..params.len()).collect();
            &identity
        }
    };

    /// One (dtype, device) group's open bucket and its place in `limits`.
    struct Open {
        key: (DType, i32),
        indices: Vec<usize>,
        bytes: usize,
        limit: usize,
    }
    let mut open: Vec<Open> = Vec::new();
    let mut result = Vec::new();
    for &i in walk {
        let p = params[i];
        let key = (p.dtype, p.device);
        let slot = match open.iter().position(|o| o.key == key) {
            Some(s) => s,
            None => {
                open.push(Open {
                    key,
                    indices: Vec::new(),
                    bytes: 0,
                    limit: 0,
                });
                open.len() - 1
            }
        };
        let b = &mut open[slot];
        b.indices.push(i);
        b.bytes = b.bytes.saturating_add(p.bytes());
        if b.bytes >= limits[b.limit] {
            result.push(std::mem::take(&mut b.indices));
            b.bytes = 0;
            if b.limit + 1 < limits.len() {
                b.limit += 1;
            }
        }
    }
    // Still-open buckets, in the order their groups first appeared (c10d
    // walks a hash map here; one group per dtype and device is the norm).
    result.extend(
        open.into_iter()
            .map(|o| o.indices)
            .filter(|v| !v.is_empty()),
    );
    if order.is_none() {
        result.sort_by_key(|b| b.iter().copied().min());
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn f32s(numels: &[usize]) -> Vec<ParamInfo> {
        numels
            .iter()
            .map(|&numel| ParamInfo {
                dtype: DType::F32,
                device: -1,
                numel,
            })
            .collect()
    }

    #[test]
    fn the_default_caps_give_a_small_first_bucket() {
        // Four 512 KiB f32 parameters, filled in reverse as DDP does: the
        // first bucket closes at 1 MiB (two tensors), the rest share one.
        let p = f32s(&[128 * 1024; 4]);
        let rev: Vec<usize> = (0..4).rev().collect();
        let b = assign_buckets(&p, &bucket_limits(None), Some(&rev)).unwrap();
        assert_eq!(b, vec![vec![3, 2], vec![1, 0]]);
    }

    #[test]
    fn a_bucket_overshoots_by_at_most_one_tensor() {
        let p = f32s(&[10, 300, 10, 10]);
        let b = assign_buckets(&p, &[100 * 4], None).unwrap();
        assert_eq!(b, vec![vec![0, 1], vec![2, 3]]);
    }

    #[test]
    fn dtypes_and_devices_get_their_own_buckets() {
        let mut p = f32s(&[4, 4, 4]);
        p[1].dtype = DType::F16;
        p[2].device = 0;
        let b = assign_buckets(&p, &[1 << 20], None).unwrap();
        assert_eq!(b, vec![vec![0], vec![1], vec![2]]);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let p = f32s(&[1, 1]);
        assert_eq!(assign_buckets(&p, &[], None), Err(BucketError::NoLimits));
        assert!(matches!(
            assign_buckets(&p, &[4], Some(&[0, 0])),
            Err(BucketError::BadOrder {
                problem: "repeated",
                ..
            })
        ));
        assert!(matches!(
            assign_buckets(&p, &[4], Some(&[0, 2])),
            Err(BucketError::BadOrder {
                problem: "out of range",
                ..
            })
        ));
        assert!(matches!(
            assign_buckets(&p, &[4], Some(&[1])),
            Err(BucketError::BadOrder {
                problem: "missing",
                ..
            })
        ));
        assert_eq!(assign_buckets(&[], &[4], None), Ok(vec![]));
    }

    proptest! {
        /// Every parameter lands in exactly one bucket, with its own
        /// (dtype, device) group only, in fill order, and every bucket but
        /// a group's last stays under its cap until its last tensor.
        #[test]
        fn assignment_covers_each_parameter_once_in_order_within_caps(
            numels in prop::collection::vec(0usize..5000, 0..40),
            kinds in prop::collection::vec(0usize..3, 40),
            caps in prop::collection::vec(1usize..40_000, 1..3),
            reverse in any::<bool>(),
        ) {
            let p: Vec<ParamInfo> = numels.iter().zip(&kinds).map(|(&numel, &k)| ParamInfo {
                dtype: [DType::F32, DType::F16, DType::F64][k],
                device: -1,
                numel,
            }).collect();
            let order: Vec<usize> = if reverse { (0..p.len()).rev().collect() } else { (0..p.len()).collect() };
            let b = assign_buckets(&p, &caps, Some(&order)).unwrap();
            let mut seen: Vec<usize> = b.iter().flatten().copied().collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..p.len()).collect::<Vec<_>>());
            let pos = |i: usize| order.iter().position(|&o| o == i).unwrap();
            for bucket in &b {
                prop_assert!(!bucket.is_empty());
                prop_assert!(bucket.iter().all(|&i| p[i].dtype == p[bucket[0]].dtype));
                prop_assert!(bucket.windows(2).all(|w| pos(w[0]) < pos(w[1])));
                let before_last: usize = bucket[..bucket.len() - 1].iter().map(|&i| p[i].bytes()).sum();
                prop_assert!(before_last < *caps.iter().max().unwrap());
            }
        }
    }
}
