//! Feeds arbitrary bytes to the TCPStore server's request decoder, as one
//! client's connection (the first byte picks whether VALIDATE came
//! first). It must never panic, must end when the bytes run out or a rule
//! is broken, and must give back every byte it reserved from the memory
//! budget.
#![no_main]

use consort_tcp::store::fuzzing::feed;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let fed = feed(rest, first & 1 == 1);
    assert!(fed.ended, "the decoder did not end on {} bytes", rest.len());
    assert_eq!(fed.leaked, 0, "bytes left reserved in the budget");
});
