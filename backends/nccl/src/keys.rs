//! Where NCCL's unique id lives in the store, under PyTorch's layout, so
//! that one store (ours or torch's) serves both.
//!
//! torch nests `PrefixStore`s as `default_pg/` → `<group name>/` →
//! `<device>/`, each joined to the next with "/", and rank 0 sets the
//! 128-byte `ncclUniqueId` under `str(counter)`. The first communicator of
//! the default group is therefore `default_pg/0//cuda//0` (the TCPStore
//! client adds the leading "/" on the wire).

/// Bytes of an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// The store key of communicator `counter` of group `group` (`"0"` is the
/// default group).
pub fn unique_id_key(group: &str, counter: u64) -> String {
    format!("default_pg/{group}//cuda//{counter}")
}

/// Checks a value read from the store: it must be exactly one unique id.
pub fn check_unique_id(key: &str, value: &[u8]) -> Result<[u8; UNIQUE_ID_BYTES], String> {
    value.try_into().map_err(|_| {
        format!(
            "the store value under {key:?} has {} bytes; an ncclUniqueId has {UNIQUE_ID_BYTES}. \
             Another job (or a different library version) may share this store and prefix",
            value.len()
        )
    })
}
