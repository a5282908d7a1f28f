//! Feeds arbitrary bytes to the frame header decoder. It must never panic,
//! and whatever it accepts must encode back to the same bytes and respect
//! the configured payload limit.
#![no_main]

use consort_comm::frame::{FrameHeader, FrameKind, FrameLimits, HEADER_LEN, MAX_ABORT_MESSAGE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = FrameLimits {
        max_payload: 1 << 20,
    };
    if let Ok(h) = FrameHeader::decode(data, &limits) {
        assert_eq!(&h.encode()[..], &data[..HEADER_LEN]);
        match h.kind {
            FrameKind::Data | FrameKind::Pull => assert!(h.payload_len <= limits.max_payload),
            FrameKind::Probe | FrameKind::ProbeReply => assert_eq!(h.payload_len, 0),
            FrameKind::Abort => assert!(h.payload_len <= MAX_ABORT_MESSAGE),
        }
    }
});
