//! Copies into destinations larger than the caches, with stores that
//! bypass them (non-temporal stores).
//!
//! An ordinary store first reads the destination's cache line from memory
//! (write-allocate), so a copy into a buffer that is not cached moves its
//! bytes through memory three times: read the source, read the
//! destination, write it back. A streaming store writes whole lines
//! without reading them. On a host whose ranks share its memory bandwidth
//! (same-host collectives are memory-bound: see BENCHMARKS.md), that is a
//! third of a receiver's traffic. Worth it only where nothing reads the
//! destination soon: a large receive that the schedule does not forward at
//! once (see [`STREAMING_MIN`]).

/// Receives at least this large are copied into place with [`streaming`]: about
/// a quarter of a server's last-level cache, so that a receive this large
/// would push most of what the caches hold out anyway.
pub const STREAMING_MIN: usize = 8 << 20;

/// Copies `src` into `dst` (equal lengths), bypassing the caches for the
/// destination's whole 16-byte blocks where the CPU has streaming stores
/// (every x86-64); elsewhere, and for the unaligned ends, an ordinary copy.
/// The stores are fenced before it returns, so the bytes are visible to
/// every later load, here and (through the atomics that publish them) in
/// other threads and processes.
///
/// # Panics
///
/// If the lengths differ, as `copy_from_slice` does.
pub fn streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "streaming copy needs equal lengths");
    #[cfg(target_arch = "x86_64")]
    {
        // Bytes before the destination's first 16-byte boundary.
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        let body = (dst.len() - head) & !15;
        dst[..head].copy_from_slice(&src[..head]);
        // SAFETY: `dst[head..head + body]` is 16-aligned and `body` is a
        // multiple of 16 within both slices (equal lengths); SSE2 is part
        // of x86-64.
        unsafe { stream_body(dst[head..].as_mut_ptr(), src[head..].as_ptr(), body) };
        dst[head + body..].copy_from_slice(&src[head + body..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Streams `len` bytes (a multiple of 16) from `src` to 16-aligned `dst`.
///
/// # Safety
///
/// Both ranges lie inside live allocations that do not overlap, `dst` is
/// 16-aligned and `len` a multiple of 16.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_body(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    if len == 0 {
        return;
    }
    let mut off = 0;
    // Four blocks (one 64-byte line, when `dst` is line-aligned) per turn.
    while off + 64 <= len {
        // SAFETY: `off + 64 <= len`: inside both ranges (the caller's).
        unsafe {
            let s = src.add(off).cast::<__m128i>();
            let d = dst.add(off).cast::<__m128i>();
            let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
            let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        off += 64;
    }
    while off < len {
        // SAFETY: `off + 16 <= len` (a multiple of 16).
        unsafe {
            let v = _mm_loadu_si128(src.add(off).cast::<__m128i>());
            _mm_stream_si128(dst.add(off).cast::<__m128i>(), v);
        }
        off += 16;
    }
    // Streaming stores are weakly ordered: fence them before anything that
    // publishes the bytes.
    // SAFETY: SSE is part of x86-64.
    unsafe { _mm_sfence() };
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    proptest! {
        /// Any length at any offset of source and destination (the
        /// unaligned ends, a body shorter than a line, none at all) copies
        /// exactly, and touches nothing around the destination.
        #[test]
        fn copies_exactly(len in 0usize..1200, d_off in 0usize..40, s_off in 0usize..40, seed: u8) {
            let src: Vec<u8> = (0..len + s_off).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
            let mut dst = vec![0xA5u8; len + d_off + 40];
            super::streaming(&mut dst[d_off..d_off + len], &src[s_off..]);
            prop_assert_eq!(&dst[d_off..d_off + len], &src[s_off..]);
            prop_assert!(dst[..d_off].iter().all(|&b| b == 0xA5));
            prop_assert!(dst[d_off + len..].iter().all(|&b| b == 0xA5));
        }
    }

    #[test]
    fn large_copy_matches() {
        let src: Vec<u8> = (0..(3 << 20) + 13).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        super::streaming(&mut dst, &src);
        assert!(dst == src);
    }

    #[test]
    #[should_panic(expected = "equal lengths")]
    fn unequal_lengths_panic_as_copy_from_slice_does() {
        super::streaming(&mut [0u8; 4], &[0u8; 5]);
    }
}
