use super::*;

#[test]
fn bitwise_on_floats_is_unsupported_for_every_float_dtype() {
    for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
        let mut d = [1.0f32];
        let e = op.apply(&mut d, &[2.0]).unwrap_err();
        assert!(matches!(e, CommError::Unsupported { .. }), "{e}");
        for dt in [DType::F64, DType::F16, DType::BF16] {
            assert!(op.check(dt).is_err());
        }
        assert!(op.check(DType::I32).is_ok());
    }
}

#[test]
fn length_mismatch_is_an_error_not_a_panic() {
    let mut d = [1i32, 2];
    assert!(matches!(
        ReduceOp::Sum.apply(&mut d, &[1]),
        Err(CommError::InvalidArgument { .. })
    ));
    let mut bytes = [0u8; 6];
    assert!(
        ReduceOp::Sum
            .apply_bytes(DType::F32, &mut bytes, &[0u8; 6])
            .is_err()
    );
}

#[test]
fn nan_and_inf_behave_as_documented() {
    let mut d = [f32::NAN, 1.0, 1.0, f32::INFINITY];
    ReduceOp::Min
        .apply(&mut d, &[0.0, f32::NAN, 2.0, f32::NEG_INFINITY])
        .unwrap();
    assert!(d[0].is_nan() && d[1].is_nan());
    assert_eq!(d[2], 1.0);
    assert_eq!(d[3], f32::NEG_INFINITY);
    let mut s = [f32::INFINITY];
    ReduceOp::Sum.apply(&mut s, &[f32::NEG_INFINITY]).unwrap();
    assert!(s[0].is_nan());
    let mut h = [f16::MAX];
    ReduceOp::Sum.apply(&mut h, &[f16::MAX]).unwrap();
    assert_eq!(h[0], f16::INFINITY);
}

#[test]
fn half_conversions_match_the_half_crate_exhaustively() {
    for bits in 0..=u16::MAX {
        let h = f16::from_bits(bits);
        let w = f16_bits_to_f32(bits);
        assert!(
            w.to_bits() == h.to_f32().to_bits() || (w.is_nan() && h.is_nan()),
            "{bits:#x}"
        );
        let b = bf16::from_bits(bits);
        let f = f32::from_bits(u32::from(bits) << 16);
        assert!(f.to_bits() == b.to_f32().to_bits() || (f.is_nan() && b.is_nan()));
    }
    // Narrowing: every f32 whose low bits sit at and around each f16 and
    // bf16 rounding boundary, plus specials.
    let mut probes = vec![
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        65504.0,
        65520.0,
        65519.99,
        1e-8,
        5.96e-8,
        2.98e-8,
        2.99e-8,
        f32::MAX,
        f32::MIN_POSITIVE,
    ];
    for bits in (0..=u32::MAX).step_by(4099) {
        probes.push(f32::from_bits(bits));
    }
    for h in (0..=u16::MAX).step_by(7) {
        let base = u32::from(h) << 16;
        for low in [0u32, 0x7fff, 0x8000, 0x8001, 0xffff] {
            probes.push(f32::from_bits(base | low));
        }
        let x = f16::from_bits(h).to_f32().to_bits();
        for d in [0u32, 1, 0xfff, 0x1000, 0x1001, 0x2000] {
            probes.push(f32::from_bits(x.wrapping_add(d)));
            probes.push(f32::from_bits(x.wrapping_sub(d)));
        }
    }
    for p in probes {
        let want = f16::from_f32(p);
        let got = f16::from_bits(f32_to_f16_bits(p));
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "f16 {p:e} ({:#x}): {:#x} vs {:#x}",
            p.to_bits(),
            got.to_bits(),
            want.to_bits()
        );
        let want = bf16::from_f32(p);
        let got = bf16::from_bits(f32_to_bf16_bits(p));
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "bf16 {p:e}"
        );
    }
}

/// The portable 16-bit path, which CPUs without F16C/AVX2 take, gives
/// the same bits as the dispatched one.
#[test]
fn portable_and_dispatched_half_paths_agree() {
    let vals: Vec<f32> = (0..1000)
        .map(|i| (i as f32 - 500.0) * 0.37)
        .chain([f32::NAN, f32::INFINITY, -0.0, 70000.0, 1e-7])
        .collect();
    for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
        let d16: Vec<f16> = vals.iter().map(|v| f16::from_f32(*v)).collect();
        let s16: Vec<f16> = vals.iter().rev().map(|v| f16::from_f32(*v)).collect();
        let (mut a, mut b) = (d16.clone(), d16);
        combine_half(op, &mut a, &s16);
        op.apply(&mut b, &s16).unwrap();
        assert!(
            a.iter()
                .zip(&b)
                .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())),
            "f16 {op}"
        );
        let d: Vec<bf16> = vals.iter().map(|v| bf16::from_f32(*v)).collect();
        let s: Vec<bf16> = vals.iter().rev().map(|v| bf16::from_f32(*v)).collect();
        let (mut a, mut b) = (d.clone(), d);
        combine_half(op, &mut a, &s);
        op.apply(&mut b, &s).unwrap();
        assert!(
            a.iter()
                .zip(&b)
                .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())),
            "bf16 {op}"
        );
    }
}

#[test]
fn premul_sum_scales_first_and_compares_without_its_factor() {
    let op = ReduceOp::premul_sum(0.5);
    let mut x = [2.0f32, -3.0];
    op.prescale_bytes(DType::F32, crate::dtype::as_bytes_mut(&mut x), 4)
        .unwrap();
    assert_eq!(x, [1.0, -1.5]);
    op.apply(&mut x, &[1.0, 1.0]).unwrap();
    op.finalize(&mut x, 4).unwrap();
    assert_eq!(x, [2.0, -0.5]);
    assert_eq!(op.code(), 8);
    assert_eq!(ReduceOp::from_code(8), Some(ReduceOp::premul_sum(1.0)));
    assert_eq!(op.compared(), ReduceOp::premul_sum(3.0).compared());
    assert_ne!(op, ReduceOp::premul_sum(3.0));
    assert!(matches!(
        op.check(DType::I32),
        Err(CommError::Unsupported { .. })
    ));
    assert_eq!(ReduceOp::Sum.prescale(DType::F32, 4), None);
}

#[test]
fn half_avg_divides_before_the_sum_and_stays_in_range() {
    let n = 4;
    let mut a = [f16::from_f32(60000.0); 2];
    let mut b = a;
    for v in [&mut a, &mut b] {
        ReduceOp::Avg
            .prescale_bytes(DType::F16, crate::dtype::as_bytes_mut(v), n)
            .unwrap();
    }
    for _ in 1..n {
        ReduceOp::Avg.apply(&mut a, &b).unwrap();
    }
    ReduceOp::Avg.finalize(&mut a, n).unwrap();
    assert_eq!(a[0].to_f32(), 60000.0);
    // f32 still divides once at the end, as Gloo does.
    assert_eq!(ReduceOp::Avg.prescale(DType::F32, n), None);
    assert_eq!(ReduceOp::Avg.prescale(DType::BF16, n), Some(0.25));
}

#[test]
fn avg_divides_once_in_finalize() {
    let mut d = [2.0f32, 4.0];
    ReduceOp::Avg.apply(&mut d, &[4.0, 8.0]).unwrap();
    assert_eq!(d, [6.0, 12.0]);
    ReduceOp::Avg.finalize(&mut d, 2).unwrap();
    assert_eq!(d, [3.0, 6.0]);
    let mut i = [-7i32, 7];
    ReduceOp::Avg.finalize(&mut i, 2).unwrap();
    assert_eq!(i, [-3, 3]);
    let mut u = [200u8];
    ReduceOp::Avg.finalize(&mut u, 1000).unwrap();
    assert_eq!(u, [0]);
    ReduceOp::Sum.finalize(&mut d, 0).unwrap();
    assert!(ReduceOp::Avg.finalize(&mut d, 0).is_err());
}

#[test]
fn unaligned_source_bytes_give_the_same_result() {
    let dst: Vec<f64> = (0..1000).map(|i| i as f64).collect();
    let src: Vec<f64> = (0..1000).map(|i| (i * 3) as f64).collect();
    let mut want = dst.clone();
    ReduceOp::Sum.apply(&mut want, &src).unwrap();

    let mut shifted = vec![0u8; 8001];
    shifted[1..].copy_from_slice(bytemuck::cast_slice(&src));
    let mut got = dst.clone();
    ReduceOp::Sum
        .apply_bytes(
            DType::F64,
            bytemuck::cast_slice_mut(&mut got),
            &shifted[1..],
        )
        .unwrap();
    assert_eq!(got, want);
}

/// Properties against a scalar reference, one module per dtype × op.
mod proptests {
    use super::super::*;
    use proptest::prelude::*;

    /// The reference: one element at a time, written from the documented
    /// semantics rather than from the kernels.
    fn reference_f32(op: ReduceOp, a: f32, b: f32) -> f32 {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => a + b,
            ReduceOp::Prod => a * b,
            ReduceOp::Min if a.is_nan() || b.is_nan() => f32::NAN,
            ReduceOp::Max if a.is_nan() || b.is_nan() => f32::NAN,
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            _ => unreachable!(),
        }
    }

    fn reference_f64(op: ReduceOp, a: f64, b: f64) -> f64 {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => a + b,
            ReduceOp::Prod => a * b,
            ReduceOp::Min if a.is_nan() || b.is_nan() => f64::NAN,
            ReduceOp::Max if a.is_nan() || b.is_nan() => f64::NAN,
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            _ => unreachable!(),
        }
    }

    macro_rules! reference_int {
        ($name:ident, $t:ty) => {
            fn $name(op: ReduceOp, a: $t, b: $t) -> $t {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => std::cmp::min(a, b),
                    ReduceOp::Max => std::cmp::max(a, b),
                    ReduceOp::BAnd => a & b,
                    ReduceOp::BOr => a | b,
                    ReduceOp::BXor => a ^ b,
                    ReduceOp::PremulSum(_) => unreachable!(),
                }
            }
        };
    }
    reference_int!(reference_i8, i8);
    reference_int!(reference_u8, u8);
    reference_int!(reference_i32, i32);
    reference_int!(reference_i64, i64);
    reference_int!(reference_u32, u32);
    reference_int!(reference_u64, u64);

    /// Equal, treating every NaN as equal to every NaN, and ±0 as equal
    /// (the documented freedom of Min/Max).
    fn same_f64(a: f64, b: f64) -> bool {
        (a.is_nan() && b.is_nan()) || a == b
    }

    fn floats_f32() -> impl Strategy<Value = f32> + Clone {
        prop_oneof![
            4 => (-1000i32..1000).prop_map(|v| v as f32 * 0.25),
            1 => proptest::num::f32::ANY,
        ]
    }

    fn floats_f64() -> impl Strategy<Value = f64> + Clone {
        prop_oneof![
            4 => (-1000i32..1000).prop_map(|v| v as f64 * 0.25),
            1 => proptest::num::f64::ANY,
        ]
    }

    fn pairs<S: Strategy + Clone>(s: S) -> impl Strategy<Value = Vec<(S::Value, S::Value)>>
    where
        S::Value: std::fmt::Debug,
    {
        proptest::collection::vec((s.clone(), s), 0..700)
    }

    fn arith_op() -> impl Strategy<Value = ReduceOp> {
        prop::sample::select(vec![
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Prod,
            ReduceOp::Min,
            ReduceOp::Max,
        ])
    }

    fn any_op() -> impl Strategy<Value = ReduceOp> {
        prop::sample::select(ReduceOp::ALL.to_vec())
    }

    macro_rules! int_property {
        ($name:ident, $t:ty, $reference:ident) => {
            proptest! {
                #[test]
                fn $name(op in any_op(), v in pairs(any::<$t>())) {
                    let (mut d, s): (Vec<$t>, Vec<$t>) = v.into_iter().unzip();
                    let want: Vec<$t> =
                        d.iter().zip(&s).map(|(a, b)| $reference(op, *a, *b)).collect();
                    op.apply(&mut d, &s).unwrap();
                    prop_assert_eq!(d, want);
                }
            }
        };
    }
    int_property!(i8_matches_reference, i8, reference_i8);
    int_property!(u8_matches_reference, u8, reference_u8);
    int_property!(i32_matches_reference, i32, reference_i32);
    int_property!(i64_matches_reference, i64, reference_i64);
    int_property!(u32_matches_reference, u32, reference_u32);
    int_property!(u64_matches_reference, u64, reference_u64);

    proptest! {
        #[test]
        fn f32_matches_reference(op in arith_op(), v in pairs(floats_f32())) {
            let (mut d, s): (Vec<f32>, Vec<f32>) = v.into_iter().unzip();
            let want: Vec<f32> =
                d.iter().zip(&s).map(|(a, b)| reference_f32(op, *a, *b)).collect();
            op.apply(&mut d, &s).unwrap();
            for (g, w) in d.iter().zip(&want) {
                prop_assert!(same_f64(*g as f64, *w as f64), "{} vs {}", g, w);
            }
        }

        #[test]
        fn f64_matches_reference(op in arith_op(), v in pairs(floats_f64())) {
            let (mut d, s): (Vec<f64>, Vec<f64>) = v.into_iter().unzip();
            let want: Vec<f64> =
                d.iter().zip(&s).map(|(a, b)| reference_f64(op, *a, *b)).collect();
            op.apply(&mut d, &s).unwrap();
            for (g, w) in d.iter().zip(&want) {
                prop_assert!(same_f64(*g, *w), "{} vs {}", g, w);
            }
        }

        #[test]
        fn f16_matches_f32_reference(op in arith_op(), v in pairs(floats_f32())) {
            let (d0, s0): (Vec<f32>, Vec<f32>) = v.into_iter().unzip();
            let mut d: Vec<f16> = d0.iter().map(|x| f16::from_f32(*x)).collect();
            let s: Vec<f16> = s0.iter().map(|x| f16::from_f32(*x)).collect();
            let want: Vec<f16> = d.iter().zip(&s)
                .map(|(a, b)| f16::from_f32(reference_f32(op, a.to_f32(), b.to_f32())))
                .collect();
            op.apply(&mut d, &s).unwrap();
            for (g, w) in d.iter().zip(&want) {
                prop_assert!(same_f64(g.to_f64(), w.to_f64()), "{} vs {}", g, w);
            }
        }

        #[test]
        fn bf16_matches_f32_reference(op in arith_op(), v in pairs(floats_f32())) {
            let (d0, s0): (Vec<f32>, Vec<f32>) = v.into_iter().unzip();
            let mut d: Vec<bf16> = d0.iter().map(|x| bf16::from_f32(*x)).collect();
            let s: Vec<bf16> = s0.iter().map(|x| bf16::from_f32(*x)).collect();
            let want: Vec<bf16> = d.iter().zip(&s)
                .map(|(a, b)| bf16::from_f32(reference_f32(op, a.to_f32(), b.to_f32())))
                .collect();
            op.apply(&mut d, &s).unwrap();
            for (g, w) in d.iter().zip(&want) {
                prop_assert!(same_f64(g.to_f64(), w.to_f64()), "{} vs {}", g, w);
            }
        }

        #[test]
        fn avg_finalize_matches_division(
            v in proptest::collection::vec(-1_000_000i64..1_000_000, 0..300),
            n in 1usize..70,
        ) {
            let mut f: Vec<f64> = v.iter().map(|x| *x as f64).collect();
            let mut i = v.clone();
            ReduceOp::Avg.finalize(&mut f, n).unwrap();
            ReduceOp::Avg.finalize(&mut i, n).unwrap();
            for ((x, got_f), got_i) in v.iter().zip(&f).zip(&i) {
                prop_assert_eq!(*got_f, *x as f64 / n as f64);
                prop_assert_eq!(*got_i, *x / n as i64);
            }
        }
    }
}
