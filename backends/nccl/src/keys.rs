//! Where NCCL's unique id lives in the store, under PyTorch's layout, so
//! that one store (ours or torch's) serves both.
//!
//! torch nests `PrefixStore`s as `default_pg/` → `<group name>/` →
//! `<device>/`, each joined to the next with "/", and rank 0 sets the
//! 128-byte `ncclUniqueId` under `str(counter)`. The first communicator of
//! the default group is therefore `default_pg/0//cuda//0` (the TCPStore
//! client adds the leading "/" on the wire).
//!
//! torch 2.15's `"nccl"` is **nccl2** (torchcomms' port), which keeps the
//! id one level down, under `<group store>/nccl_storekey_<generation>`
//! (raw key `default_pg/0//cuda//0/nccl_storekey_0` for the default group),
//! and splits a `new_group` with colour `min(ranks)`; the classic
//! ProcessGroupNCCL (`"nccl-legacy"`, or `TORCH_DIST_USE_NCCL2=0`) keeps it
//! under `str(counter)` and splits with colour
//! `abs(hash(tuple(global_ranks))) % 2**31`, CPython's tuple hash (which
//! does not depend on `PYTHONHASHSEED` for integers). [`TorchNccl`] says
//! which one a job runs; a consort rank uses its keys and colours, so it
//! can sit in a torch job's group. The value is the raw 128-byte
//! `ncclUniqueId` in both (torchcomms' `exchangeUniqueIdStore` sets and
//! checks exactly `sizeof(ncclUniqueId)` bytes; to confirm against torch
//! on a GPU). Newer torchcomms (after 2.15) key the id by the
//! communicator's name instead of a count (`nccl_storekey_<name>`): a
//! torch release that moves to it changes [`torch_unique_id_key`].
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

/// torch's NCCL backends: whose store keys and split colours to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TorchNccl {
    /// torch 2.15's `"nccl"`: nccl2.
    #[default]
    Nccl2,
    /// The classic ProcessGroupNCCL (`"nccl-legacy"`).
    Legacy,
}

impl TorchNccl {
    /// As torch chooses: `TORCH_DIST_USE_NCCL2=0` means the classic
    /// backend, anything else (or nothing) nccl2.
    pub fn from_env() -> Self {
        match std::env::var("TORCH_DIST_USE_NCCL2").as_deref() {
            Ok("0") => TorchNccl::Legacy,
            _ => TorchNccl::Nccl2,
        }
    }
}

/// How a `new_group`'s communicator is made, as torch makes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SubgroupBootstrap {
    /// `ncclCommSplit` of the parent: every rank of the parent calls it,
    /// members with [`split_color`], the rest with no colour.
    Split,
    /// A fresh unique id that the group's first rank sets in the store
    /// under the group's own name ([`torch_unique_id_key`] of
    /// [`torch_group_name`], generation 0); only members take part.
    StoreId,
}

/// How `backend` makes a `new_group`'s communicator: nccl2 always splits
/// the parent; the classic backend splits only when the default group was
/// made eagerly (`init_process_group(device_id=...)`, `eager`), and
/// otherwise makes a fresh communicator from an id in the store at the
/// group's first collective.
pub fn torch_subgroup_bootstrap(backend: TorchNccl, eager: bool) -> SubgroupBootstrap {
    match backend {
        TorchNccl::Legacy if !eager => SubgroupBootstrap::StoreId,
        _ => SubgroupBootstrap::Split,
    }
}

/// torch's name for the `count`-th group a job makes (`str(group_count)`:
/// the default group is 0, each `new_group` after it the next number,
/// counted on every rank, member or not).
pub fn torch_group_name(count: u64) -> String {
    count.to_string()
}

/// The colour `ncclCommSplit` gets for a group of these global ranks, as
/// `backend` computes it (every member passes the same; both fit NCCL's
/// non-negative `int`).
pub fn split_color(backend: TorchNccl, global_ranks: &[usize]) -> u32 {
    match backend {
        // Ranks are below MAX_WORLD_SIZE, far under 2^31.
        TorchNccl::Nccl2 => global_ranks.iter().copied().min().unwrap_or(0) as u32 & 0x7fff_ffff,
        TorchNccl::Legacy => {
            let h = cpython_tuple_hash(global_ranks.iter().map(|&r| r as i64));
            (h.unsigned_abs() % (1 << 31)) as u32
        }
    }
}

/// The store key of a group's communicator id: `group` is torch's group
/// name (`"0"` for the default group), `generation` nccl2's per-group
/// count or the classic backend's counter.
pub fn torch_unique_id_key(backend: TorchNccl, group: &str, generation: u64) -> String {
    match backend {
        TorchNccl::Nccl2 => format!("{}/nccl_storekey_{generation}", unique_id_key(group, 0)),
        TorchNccl::Legacy => unique_id_key(group, generation),
    }
}

/// CPython's `hash(int)` for an `i64` (64-bit builds): the value modulo
/// the Mersenne prime 2**61 - 1, sign kept, -1 mapped to -2.
fn cpython_int_hash(v: i64) -> i64 {
    const MODULUS: i128 = (1 << 61) - 1;
    let m = (i128::from(v).abs() % MODULUS) as i64;
    let h = if v < 0 { -m } else { m };
    if h == -1 { -2 } else { h }
}

/// CPython's `hash(tuple)` (3.8+, xxHash's round on 64-bit builds).
fn cpython_tuple_hash(items: impl ExactSizeIterator<Item = i64>) -> i64 {
    const P1: u64 = 11_400_714_785_074_694_791;
    const P2: u64 = 14_029_467_366_897_019_727;
    const P5: u64 = 2_870_177_450_012_600_261;
    let len = items.len() as u64;
    let mut acc = P5;
    for item in items {
        let lane = cpython_int_hash(item) as u64;
        acc = acc.wrapping_add(lane.wrapping_mul(P2));
        acc = acc.rotate_left(31);
        acc = acc.wrapping_mul(P1);
    }
    acc = acc.wrapping_add(len ^ (P5 ^ 3_527_539));
    if acc == u64::MAX {
        return 1_546_275_796;
    }
    acc as i64
}

#[cfg(test)]
mod tests {
    #[test]
    fn subgroups_are_made_as_each_torch_backend_makes_them() {
        assert_eq!(
            torch_subgroup_bootstrap(TorchNccl::Nccl2, false),
            SubgroupBootstrap::Split
        );
        assert_eq!(
            torch_subgroup_bootstrap(TorchNccl::Nccl2, true),
            SubgroupBootstrap::Split
        );
        assert_eq!(
            torch_subgroup_bootstrap(TorchNccl::Legacy, true),
            SubgroupBootstrap::Split
        );
        assert_eq!(
            torch_subgroup_bootstrap(TorchNccl::Legacy, false),
            SubgroupBootstrap::StoreId
        );
        // The classic backend's first new_group, lazily: group "1",
        // counter 0.
        assert_eq!(
            torch_unique_id_key(TorchNccl::Legacy, &torch_group_name(1), 0),
            "default_pg/1//cuda//0"
        );
    }

    use std::sync::Arc;

    use consort_comm::store::{MemStore, PrefixStore, Store};

    use super::*;

    /// A restarted round's id never lands on (or is read from) the key the
    /// first round used, and each round has keys of its own.
    #[test]
    fn torch_2_15_keys_for_each_backend() {
        assert_eq!(
            torch_unique_id_key(TorchNccl::Nccl2, "0", 0),
            "default_pg/0//cuda//0/nccl_storekey_0"
        );
        assert_eq!(
            torch_unique_id_key(TorchNccl::Nccl2, "3", 2),
            "default_pg/3//cuda//0/nccl_storekey_2"
        );
        assert_eq!(
            torch_unique_id_key(TorchNccl::Legacy, "0", 1),
            "default_pg/0//cuda//1"
        );
    }

    /// CPython's own values (python3 -c 'print(hash((0, 1)))', 3.8+, 64-bit).
    #[test]
    fn legacy_colours_are_cpythons_tuple_hash() {
        assert_eq!(
            cpython_tuple_hash([0i64, 1].into_iter()),
            -1_950_498_447_580_522_560
        );
        assert_eq!(
            cpython_tuple_hash([].into_iter()),
            5_740_354_900_026_072_187
        );
        assert_eq!(
            cpython_tuple_hash([5i64].into_iter()),
            -7_813_438_383_599_366_905
        );
        assert_eq!(
            cpython_tuple_hash([-1i64].into_iter()),
            8_078_679_518_589_016_365
        );
        assert_eq!(
            cpython_tuple_hash([1i64 << 62].into_iter()),
            6_909_455_589_863_252_355
        );
        assert_eq!(split_color(TorchNccl::Legacy, &[0, 1]), 2_130_503_744);
        assert_eq!(split_color(TorchNccl::Nccl2, &[4, 2, 7]), 2);
    }

    /// The same against the python3 on this machine, for many rank lists
    /// (CI has python3; without it the fixed values above still hold).
    #[test]
    fn legacy_colours_equal_python_for_many_rank_lists() {
        let lists: Vec<Vec<usize>> = (0..200)
            .map(|i| (0..(i % 9)).map(|k| (i * 7 + k * 13) % 4096).collect())
            .collect();
        let script = format!("for l in {lists:?}: print(abs(hash(tuple(l))) % 2**31)");
        let Ok(out) = std::process::Command::new("python3")
            .args(["-c", &script])
            .output()
        else {
            eprintln!(
                "no python3 here: the fixed values of legacy_colours_are_cpythons_tuple_hash stand"
            );
            return;
        };
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let want: Vec<u32> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        let got: Vec<u32> = lists
            .iter()
            .map(|l| split_color(TorchNccl::Legacy, l))
            .collect();
        assert_eq!(got, want);
    }

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
