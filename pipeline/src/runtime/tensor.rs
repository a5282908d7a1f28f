//! The host tensors that cross stage boundaries, and torch's microbatch
//! split and merge along the batch dimension.

use consort_comm::Element;

/// A dense row-major tensor on the host: what a stage hands the next one
/// (activations) and the previous one (their gradients). Convert to and
/// from your tensor library's type at the stage's edges.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor<T> {
    /// Sizes of each dimension; the first is the batch.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` elements, row-major.
    pub data: Vec<T>,
}

impl<T: Element> Tensor<T> {
    /// A tensor of `shape` holding `data`; `None` when the sizes disagree.
    pub fn new(shape: Vec<usize>, data: Vec<T>) -> Option<Self> {
        let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
        (n == data.len()).then_some(Tensor { shape, data })
    }

    /// Elements per row of the first dimension.
    fn row(&self) -> usize {
        self.shape.iter().skip(1).product()
    }
}

/// Splits `t` along its first dimension into `chunks` microbatches as
/// `torch.tensor_split` does: the first `len % chunks` get one row more.
/// Refuses a tensor without a batch dimension or with fewer rows than
/// chunks (torch's pipelining refuses it too).
pub fn split<T: Element>(t: &Tensor<T>, chunks: usize) -> Result<Vec<Tensor<T>>, String> {
    let Some(&rows) = t.shape.first() else {
        return Err("a 0-d tensor has no batch dimension to split into microbatches".into());
    };
    if t.data.len() != t.shape.iter().product::<usize>() {
        return Err(format!(
            "a tensor of shape {:?} holds {} elements",
            t.shape,
            t.data.len()
        ));
    }
    if rows < chunks {
        return Err(format!(
            "a batch of {rows} rows cannot be split into {chunks} microbatches; use a batch of at \
             least {chunks} rows or fewer microbatches"
        ));
    }
    let row = t.row();
    let (base, extra) = (rows / chunks, rows % chunks);
    let mut at = 0;
    Ok((0..chunks)
        .map(|i| {
            let n = base + usize::from(i < extra);
            let mut shape = t.shape.clone();
            shape[0] = n;
            let data = t.data[at * row..(at + n) * row].to_vec();
            at += n;
            Tensor { shape, data }
        })
        .collect())
}

/// Concatenates microbatches along the first dimension (torch's default
/// output merge).
pub fn merge<T: Element>(parts: Vec<Tensor<T>>) -> Result<Tensor<T>, String> {
    let mut it = parts.into_iter();
    let Some(mut out) = it.next() else {
        return Err("no microbatch outputs to merge".into());
    };
    for p in it {
        if p.shape.len() != out.shape.len() || p.shape.get(1..) != out.shape.get(1..) {
            return Err(format!(
                "microbatch outputs of shapes {:?} and {:?} cannot be concatenated along the batch",
                out.shape, p.shape
            ));
        }
        out.shape[0] += p.shape[0];
        out.data.extend(p.data);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn split_is_torch_tensor_split_and_merge_inverts_it(rows in 0usize..20, cols in 0usize..4, chunks in 1usize..8) {
            let t = Tensor::new(vec![rows, cols], (0..rows * cols).map(|i| i as f32).collect()).unwrap();
            match split(&t, chunks) {
                Err(e) => prop_assert!(rows < chunks, "{e}"),
                Ok(parts) => {
                    prop_assert_eq!(parts.len(), chunks);
                    for (i, p) in parts.iter().enumerate() {
                        // torch.tensor_split: sizes differ by at most one, larger first.
                        prop_assert_eq!(p.shape[0], rows / chunks + usize::from(i < rows % chunks));
                    }
                    prop_assert_eq!(merge(parts).unwrap(), t);
                }
            }
        }
    }

    #[test]
    fn bad_tensors_are_refused() {
        assert!(Tensor::<f32>::new(vec![2, 3], vec![0.0; 5]).is_none());
        assert!(Tensor::<f32>::new(vec![usize::MAX, 3], vec![]).is_none());
        let scalar = Tensor::new(vec![], vec![1.0f32]).unwrap();
        assert!(split(&scalar, 1).unwrap_err().contains("batch dimension"));
        assert!(merge::<f32>(vec![]).is_err());
        let a = Tensor::new(vec![1, 2], vec![0.0f32; 2]).unwrap();
        let b = Tensor::new(vec![1, 3], vec![0.0f32; 3]).unwrap();
        assert!(merge(vec![a, b]).unwrap_err().contains("concatenated"));
    }
}
