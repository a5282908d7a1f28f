//! Where NCCL's unique id lives in the store, under PyTorch's layout, so
//! that one store (ours or torch's) serves both.
//!
//! torch nests `PrefixStore`s as `default_pg/` → `<group name>/` →
//! `<device>/`, each joined to the next with "/", and rank 0 sets the
//! 128-byte `ncclUniqueId` under `str(counter)`. The first communicator of
//! the default group is therefore `default_pg/0//cuda//0` (the TCPStore
//! client adds the leading "/" on the wire).
//!
//! A restarted round must not read the id the previous round left in the
//! same store (the launcher's store lives across rounds): from the first
//! restart on, the keys sit under `/worker/attempt_{n}`, the prefix
//! torchrun's workers put their store under (torch ≤ 2.14's
//! `_create_c10d_store`); round 0 keeps torch 2.15's unprefixed layout.

/// Bytes of an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// The store key of communicator `counter` of group `group` (`"0"` is the
/// default group).
pub fn unique_id_key(group: &str, counter: u64) -> String {
    format!("default_pg/{group}//cuda//{counter}")
}

/// The prefix of round `restart`'s keys: none for the first round, then
/// `/worker/attempt_{restart}` (see the module docs).
pub fn round_prefix(restart: u32) -> Option<String> {
    (restart > 0).then(|| format!("/worker/attempt_{restart}"))
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use consort_comm::store::{MemStore, PrefixStore, Store};

    use super::*;

    /// A restarted round's id never lands on (or is read from) the key the
    /// first round used, and each round has keys of its own.
    #[tokio::test]
    async fn each_restart_has_its_own_unique_id_key() {
        assert_eq!(round_prefix(0), None);
        let mem: Arc<dyn Store> = Arc::new(MemStore::default());
        mem.set(&unique_id_key("0", 0), b"round 0").await.unwrap();
        for restart in 1..3 {
            let p = PrefixStore::new(round_prefix(restart).unwrap(), mem.clone());
            assert!(!p.check(&[&unique_id_key("0", 0)]).await.unwrap());
            p.set(&unique_id_key("0", 0), b"fresh").await.unwrap();
            let full = format!("/worker/attempt_{restart}/default_pg/0//cuda//0");
            assert_eq!(mem.get(&full).await.unwrap(), b"fresh");
        }
        assert_eq!(mem.get(&unique_id_key("0", 0)).await.unwrap(), b"round 0");
    }
}
