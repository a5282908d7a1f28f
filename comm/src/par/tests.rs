use proptest::prelude::*;

use super::*;

/// Bytes `0..len` of a pattern that differs at every position of a part.
fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt) ^ (i >> 9) as u8)
        .collect()
}

const LENS: [usize; 9] = [
    0,
    1,
    63,
    PART_MIN,
    2 * PART_MIN - 8,
    2 * PART_MIN,
    3 * PART_MIN + 8,
    4 * PART_MIN + 40,
    (1 << 20) + 24,
];

#[test]
fn a_split_copy_is_the_copy_for_every_length_and_thread_count() {
    for threads in 1..=4 {
        let pool = Pool::new(threads);
        for len in LENS {
            for streaming in [false, true] {
                let src = pattern(len, 7);
                let mut dst = vec![0u8; len];
                copy(&pool, &mut dst, &src, streaming);
                assert!(
                    dst == src,
                    "{threads} threads, {len} bytes, streaming {streaming}"
                );
            }
        }
    }
}

#[test]
fn parts_are_whole_lines_and_cover_the_slice_once() {
    let pool = Pool::new(4);
    for len in LENS {
        let parts = pool.parts_for(len);
        assert!((1..=4).contains(&parts));
        assert!(parts == 1 || len / parts >= PART_MIN, "{len} in {parts}");
        let p = Parts {
            ptr: std::ptr::null_mut(),
            len,
            parts,
        };
        let mut at = 0;
        for i in 0..parts {
            let r = p.range(i);
            assert_eq!(r.start, at);
            assert!(i + 1 == parts || r.len().is_multiple_of(64));
            at = r.end;
        }
        assert_eq!(at, len);
    }
}

/// Every op and dtype it allows, split over 1-4 threads, against the
/// unsplit reduction, bit for bit.
#[test]
fn a_split_reduction_is_the_reduction_for_every_op_and_dtype() {
    for threads in [1, 2, 3, 4] {
        let pool = Pool::new(threads);
        for op in ReduceOp::ALL {
            for dtype in DType::ALL {
                for len in [0, 2 * PART_MIN, 3 * PART_MIN + 64, (1 << 20) + 64] {
                    let src = pattern(len, 3);
                    let start = pattern(len, 11);
                    let mut want = start.clone();
                    let want_res = op.apply_bytes(dtype, &mut want, &src);
                    let mut got = start.clone();
                    let got_res = apply_bytes(&pool, op, dtype, &mut got, &src);
                    assert_eq!(got_res.is_ok(), want_res.is_ok(), "{op:?} {dtype:?}");
                    if want_res.is_ok() {
                        assert!(
                            got == want,
                            "{op:?} {dtype:?} {len} bytes, {threads} threads"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_split_reduction_refuses_what_the_reduction_refuses() {
    let pool = Pool::new(4);
    let len = 4 * PART_MIN;
    let (mut d, s) = (vec![0u8; len], vec![0u8; len]);
    let e = apply_bytes(&pool, ReduceOp::BXor, DType::F32, &mut d, &s).unwrap_err();
    let want = ReduceOp::BXor
        .apply_bytes(DType::F32, &mut d, &s)
        .unwrap_err();
    assert_eq!(e.to_string(), want.to_string());
    let e = apply_bytes(&pool, ReduceOp::Sum, DType::F32, &mut d, &s[1..]).unwrap_err();
    assert!(e.to_string().contains("equal length"), "{e}");
    let mut odd = vec![0u8; len + 2];
    let e = apply_bytes(
        &pool,
        ReduceOp::Sum,
        DType::F32,
        &mut odd,
        &vec![0u8; len + 2],
    )
    .unwrap_err();
    assert!(e.to_string().contains("whole"), "{e}");
}

#[test]
fn a_panicking_part_panics_in_the_caller_and_the_pool_goes_on() {
    let pool = Pool::new(3);
    let done = AtomicUsize::new(0);
    let r = catch_unwind(AssertUnwindSafe(|| {
        pool.run(6, &|i| {
            if i == 4 {
                panic!("part four");
            }
            done.fetch_add(1, SeqCst);
        })
    }));
    let payload = r.expect_err("the part's panic");
    assert_eq!(
        payload.downcast_ref::<&str>(),
        Some(&"part four"),
        "its own payload"
    );
    assert_eq!(
        done.load(SeqCst),
        5,
        "every other part ran before the panic surfaced"
    );
    // Still splitting: the panic left nothing poisoned.
    let before = pool.split_jobs();
    let src = pattern(1 << 20, 1);
    let mut dst = vec![0u8; 1 << 20];
    copy(&pool, &mut dst, &src, false);
    assert!(dst == src);
    assert_eq!(
        pool.split_jobs(),
        before + 1,
        "the next job was split again"
    );
}

/// A panic payload whose own drop panics (rust-lang/rust#86027) is never
/// dropped inside the pool: it reaches the caller, and the pool goes on.
#[test]
fn a_payload_that_panics_when_dropped_reaches_the_caller() {
    struct Bomb;
    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("the payload's drop");
        }
    }
    let pool = Pool::new(4);
    for _ in 0..3 {
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, &|_| std::panic::panic_any(Bomb))
        }));
        let payload = r.expect_err("a part's panic");
        assert!(payload.is::<Bomb>());
        // Dropping it would panic here too: that is the caller's to handle.
        std::mem::forget(payload);
    }
    let src = pattern(1 << 20, 2);
    let mut dst = vec![0u8; 1 << 20];
    copy(&pool, &mut dst, &src, true);
    assert!(dst == src);
}

/// Helpers past a lowered thread count sit jobs out; raised again, they
/// take parts again.
#[test]
fn a_lowered_thread_count_keeps_jobs_to_the_new_count() {
    let pool = Pool::new(4);
    let ids = |pool: &Pool, parts: usize| {
        let seen = std::sync::Mutex::new(std::collections::HashSet::new());
        for _ in 0..50 {
            pool.run(parts, &|_| {
                seen.lock().unwrap().insert(std::thread::current().id());
                std::thread::sleep(Duration::from_micros(300));
            });
        }
        seen.into_inner().unwrap().len()
    };
    assert!(ids(&pool, 4) >= 2);
    pool.set_threads(1);
    // One thread: a job of 4 parts is not split at all, by the count...
    assert_eq!(pool.parts_for(1 << 30), 1);
    // ... and a job run with more parts anyway stays on the caller and at
    // most the helpers the count allows (none).
    assert_eq!(ids(&pool, 4), 1);
    pool.set_threads(2);
    assert!(ids(&pool, 4) <= 2);
}

#[test]
fn callers_on_several_threads_each_get_their_own_result() {
    let pool = Arc::new(Pool::new(4));
    let handles: Vec<_> = (0..4u8)
        .map(|t| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                for round in 0..50u8 {
                    let src = pattern(3 * PART_MIN + 64 * t as usize, t ^ round);
                    let mut dst = vec![0u8; src.len()];
                    copy(&pool, &mut dst, &src, round % 2 == 0);
                    assert!(dst == src, "caller {t} round {round}");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn helpers_that_slept_take_parts_again() {
    let pool = Pool::new(2);
    let src = pattern(1 << 20, 5);
    for _ in 0..3 {
        let mut dst = vec![0u8; src.len()];
        copy(&pool, &mut dst, &src, true);
        assert!(dst == src);
        // Past the helpers' spin: they sleep, and the next job wakes them.
        std::thread::sleep(HELPER_SPIN * 3);
    }
    let seen = std::sync::Mutex::new(std::collections::HashSet::new());
    for _ in 0..200 {
        pool.run(2, &|_| {
            seen.lock().unwrap().insert(std::thread::current().id());
            std::thread::sleep(Duration::from_micros(200));
        });
        if seen.lock().unwrap().len() == 2 {
            return;
        }
    }
    panic!("no helper ever took a part");
}

#[test]
fn the_thread_count_is_clamped_and_changes_for_later_jobs() {
    let pool = Pool::new(0);
    assert_eq!(pool.threads(), 1);
    assert_eq!(pool.parts_for(1 << 30), 1);
    pool.set_threads(1000);
    assert_eq!(pool.threads(), MAX_THREADS);
    assert_eq!(pool.parts_for(1 << 30), MAX_THREADS);
    assert_eq!(pool.parts_for(3 * PART_MIN), 3);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Any length, alignment and thread count: a split copy and a split
    /// f32 sum equal the unsplit ones.
    #[test]
    fn split_work_matches_unsplit(
        len in 0usize..(600 << 10),
        skew in 0usize..8,
        threads in 1usize..6,
        streaming in any::<bool>(),
    ) {
        let pool = Pool::new(threads);
        let src = pattern(len + skew, 9);
        let src = &src[skew..];
        let mut dst = vec![0u8; len + skew];
        copy(&pool, &mut dst[skew..], src, streaming);
        prop_assert!(&dst[skew..] == src);
        let n = len / 4 * 4;
        let mut want = pattern(n, 2);
        let mut got = want.clone();
        ReduceOp::Sum.apply_bytes(DType::F32, &mut want, &src[..n]).unwrap();
        apply_bytes(&pool, ReduceOp::Sum, DType::F32, &mut got, &src[..n]).unwrap();
        prop_assert!(got == want);
    }
}
