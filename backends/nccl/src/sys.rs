//! NCCL, opened by consort itself: the library search, the table of the
//! symbols consort calls, and NCCL's C constants.
//!
//! This module owns finding `libnccl.so.2` and every raw NCCL entry point.
//! cudarc's NCCL loader never tries NCCL's real soname (`libnccl.so.2`),
//! offers no path override, panics when a symbol is missing from an older
//! library, and types reduce ops as a Rust enum that the values
//! `ncclRedOpCreatePreMulSum` returns are not members of. Here:
//!
//! - the search order is `CONSORT_NCCL_LIBRARY` (a path), then the
//!   `nvidia/nccl/lib` directory of an active Python environment
//!   (`VIRTUAL_ENV`, `CONDA_PREFIX`), which is where PyTorch's pip wheel
//!   puts it, then `libnccl.so.2` and `libnccl.so` on the loader's path
//!   (LD_LIBRARY_PATH, the system). The environment's wheel comes before
//!   the system's library because torch loads its own wheel, and every rank
//!   of a job (torch's or ours) must run one NCCL version; a miss lists
//!   every name and path tried, with the loader's reason;
//! - symbols that older releases lack are optional, and each use checks
//!   the version `ncclGetVersion` reports;
//! - results, data types and reduce ops cross the boundary as `c_int`.
//!
//! It owns no policy: the backend decides what to call.

use std::{
    ffi::{CStr, c_char, c_int, c_void},
    path::PathBuf,
    sync::{Arc, OnceLock},
};

/// `ncclComm_t`.
pub type Comm = *mut c_void;
/// `cudaStream_t` (the same handle as a driver `CUstream`).
pub type Stream = *mut c_void;

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    /// The 128 opaque bytes.
    pub internal: [c_char; 128],
}

/// `ncclResult_t` values.
pub mod result {
    #![allow(missing_docs)]
    use std::ffi::c_int;
    pub const SUCCESS: c_int = 0;
    pub const UNHANDLED_CUDA_ERROR: c_int = 1;
    pub const SYSTEM_ERROR: c_int = consort_comm::ordered::check::NCCL_SYSTEM_ERROR;
    pub const INTERNAL_ERROR: c_int = 3;
    pub const INVALID_ARGUMENT: c_int = 4;
    pub const INVALID_USAGE: c_int = 5;
    pub const REMOTE_ERROR: c_int = consort_comm::ordered::check::NCCL_REMOTE_ERROR;
    pub const IN_PROGRESS: c_int = 7;
    pub const TIMEOUT: c_int = 8;
}

/// `ncclDataType_t` values.
pub mod dtype {
    #![allow(missing_docs)]
    use std::ffi::c_int;
    pub const INT8: c_int = 0;
    pub const UINT8: c_int = 1;
    pub const INT32: c_int = 2;
    pub const UINT32: c_int = 3;
    pub const INT64: c_int = 4;
    pub const UINT64: c_int = 5;
    pub const FLOAT16: c_int = 6;
    pub const FLOAT32: c_int = 7;
    pub const FLOAT64: c_int = 8;
    pub const BFLOAT16: c_int = 9;
}

/// `ncclRedOp_t` values (the built-in ones; `ncclAvg` needs NCCL 2.10).
pub mod op {
    #![allow(missing_docs)]
    use std::ffi::c_int;
    pub const SUM: c_int = 0;
    pub const PROD: c_int = 1;
    pub const MAX: c_int = 2;
    pub const MIN: c_int = 3;
    pub const AVG: c_int = 4;
}

/// `ncclScalarHostImmediate`: a pre-multiplication scalar read from host
/// memory when the collective is enqueued.
pub const SCALAR_HOST_IMMEDIATE: c_int = 1;

/// `NCCL_SPLIT_NOCOLOR`: `ncclCommSplit`'s color for ranks that join no new
/// communicator.
pub const SPLIT_NOCOLOR: c_int = -1;

/// NCCL's version code for `major.minor.patch` (`NCCL_VERSION`).
pub const fn version_code(major: i32, minor: i32, patch: i32) -> i32 {
    if major <= 2 && minor <= 8 {
        major * 1000 + minor * 100 + patch
    } else {
        major * 10000 + minor * 100 + patch
    }
}

type R = c_int;

/// `NCCL_CONFIG_UNDEF_INT`: a config field NCCL fills with its default.
pub const CONFIG_UNDEF_INT: c_int = c_int::MIN;

/// `ncclConfig_t` up to `splitShare`, as NCCL 2.18 lays it out. NCCL reads
/// `size` bytes of it, trusts `version` for which fields are set, and
/// leaves later fields at their defaults, so this prefix is valid on every
/// release from 2.14 on.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Config {
    size: usize,
    magic: u32,
    version: u32,
    /// 0: calls may return `ncclInProgress` and finish in the background
    /// (polled with `ncclCommGetAsyncError`); 1: every call blocks.
    pub blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

impl Config {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking` set.
    pub fn new(blocking: bool) -> Self {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: version_code(2, 18, 0) as u32,
            blocking: c_int::from(blocking),
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: CONFIG_UNDEF_INT,
        }
    }
}

/// Every NCCL entry point consort calls, loaded from one library. The
/// function pointers are NCCL's own (raw FFI: calling one is `unsafe`, with
/// nccl.h's rules); the library stays loaded as long as this value lives.
pub struct Nccl {
    _lib: libloading::Library,
    /// Where it was loaded from (a path, or the name the loader resolved).
    pub path: String,
    /// `ncclGetVersion`'s code (22803 for 2.28.3).
    pub version: i32,
    /// `ncclGetUniqueId`.
    pub get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> R,
    /// `ncclCommInitRank`.
    pub comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> R,
    /// `ncclCommInitRankConfig` (NCCL 2.14+).
    pub comm_init_rank_config:
        Option<unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut Config) -> R>,
    /// `ncclCommFinalize` (NCCL 2.14+).
    pub comm_finalize: Option<unsafe extern "C" fn(Comm) -> R>,
    /// `ncclCommDestroy`.
    pub comm_destroy: unsafe extern "C" fn(Comm) -> R,
    /// `ncclCommAbort`.
    pub comm_abort: unsafe extern "C" fn(Comm) -> R,
    /// `ncclCommGetAsyncError`.
    pub comm_get_async_error: unsafe extern "C" fn(Comm, *mut c_int) -> R,
    /// `ncclGetErrorString`.
    pub get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    /// `ncclGetLastError` (NCCL 2.13+).
    pub get_last_error: Option<unsafe extern "C" fn(Comm) -> *const c_char>,
    /// `ncclGroupStart`.
    pub group_start: unsafe extern "C" fn() -> R,
    /// `ncclGroupEnd`.
    pub group_end: unsafe extern "C" fn() -> R,
    /// `ncclAllReduce`.
    pub all_reduce:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> R,
    /// `ncclBroadcast`.
    pub broadcast:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> R,
    /// `ncclReduce`.
    pub reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_int,
        Comm,
        Stream,
    ) -> R,
    /// `ncclAllGather`.
    pub all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> R,
    /// `ncclReduceScatter`.
    pub reduce_scatter:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> R,
    /// `ncclSend`.
    pub send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, Stream) -> R,
    /// `ncclRecv`.
    pub recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, Stream) -> R,
    /// `ncclRedOpCreatePreMulSum(op, scalar, datatype, residence, comm)`
    /// (NCCL 2.11+).
    pub red_op_create_pre_mul_sum:
        Option<unsafe extern "C" fn(*mut c_int, *mut c_void, c_int, c_int, Comm) -> R>,
    /// `ncclRedOpDestroy(op, comm)` (NCCL 2.11+).
    pub red_op_destroy: Option<unsafe extern "C" fn(c_int, Comm) -> R>,
    /// `ncclCommSplit(comm, color, key, newcomm, config)` (NCCL 2.18+); a
    /// null config inherits the parent's.
    pub comm_split: Option<unsafe extern "C" fn(Comm, c_int, c_int, *mut Comm, *mut Config) -> R>,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("path", &self.path)
            .field("version", &self.version_string())
            .finish()
    }
}

/// The oldest NCCL consort uses: 2.7 brought `ncclSend`/`ncclRecv`.
pub const MIN_VERSION: i32 = version_code(2, 7, 0);

/// Why no NCCL could be loaded: every candidate and the loader's reason.
#[derive(Debug, Clone)]
pub struct LoadError {
    /// `(name or path, why it did not load)`, in the order tried.
    pub tried: Vec<(String, String)>,
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no usable NCCL library; tried")?;
        for (i, (what, why)) in self.tried.iter().enumerate() {
            let sep = if i == 0 { " " } else { "; " };
            write!(f, "{sep}{what} ({why})")?;
        }
        Ok(())
    }
}

/// The names and paths tried, in order (see the module docs).
pub fn candidates() -> Vec<String> {
    let mut v = Vec::new();
    if let Ok(p) = std::env::var("CONSORT_NCCL_LIBRARY")
        && !p.trim().is_empty()
    {
        v.push(p.trim().to_string());
    }
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Ok(prefix) = std::env::var(var) {
            v.extend(python_env_libs(&PathBuf::from(prefix)));
        }
    }
    v.push("libnccl.so.2".into());
    v.push("libnccl.so".into());
    v
}

/// `<prefix>/lib/python3.*/site-packages/nvidia/nccl/lib/libnccl.so.2`.
fn python_env_libs(prefix: &std::path::Path) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(prefix.join("lib")) else {
        return Vec::new();
    };
    let mut v: Vec<String> = dir
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python"))
        .map(|e| e.path().join("site-packages/nvidia/nccl/lib/libnccl.so.2"))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
    v.sort();
    v
}

/// Loads NCCL from the first candidate that opens and has every required
/// symbol, once per process.
pub fn load() -> Result<Arc<Nccl>, LoadError> {
    static NCCL: OnceLock<Result<Arc<Nccl>, LoadError>> = OnceLock::new();
    NCCL.get_or_init(|| load_from(&candidates()).map(Arc::new))
        .clone()
}

/// Loads NCCL from the first of `names` that works (tests pass their own).
pub fn load_from(names: &[String]) -> Result<Nccl, LoadError> {
    let mut tried = Vec::new();
    for name in names {
        match open(name) {
            Ok(n) => return Ok(n),
            Err(why) => tried.push((name.clone(), why)),
        }
    }
    Err(LoadError { tried })
}

/// Reads one symbol as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the symbol's C signature.
unsafe fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, String> {
    // SAFETY: forwarded: the caller names the symbol's true signature.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("it has no {name}: {e}"))
}

/// A symbol that releases before `since` lack: read only when the library
/// is new enough, and `None` when absent.
///
/// # Safety
/// As [`sym`].
unsafe fn opt<T: Copy>(
    lib: &libloading::Library,
    name: &str,
    version: i32,
    since: i32,
) -> Option<T> {
    if version < since {
        return None;
    }
    // SAFETY: forwarded.
    unsafe { sym(lib, name) }.ok()
}

fn open(name: &str) -> Result<Nccl, String> {
    // SAFETY: loading a shared library runs its initialisers; this is the
    // vendor's NCCL, which the user pointed at or installed.
    let lib = unsafe { libloading::Library::new(name) }.map_err(|e| e.to_string())?;
    // SAFETY: every signature below is copied from nccl.h (ncclResult_t,
    // ncclDataType_t, ncclRedOp_t and ncclScalarResidence_t are C enums of
    // int size; handles are pointers; size_t is usize).
    unsafe {
        let get_version: unsafe extern "C" fn(*mut c_int) -> R = sym(&lib, "ncclGetVersion")?;
        let mut version = 0;
        let r = get_version(&mut version);
        if r != result::SUCCESS {
            return Err(format!("ncclGetVersion failed with code {r}"));
        }
        if version < MIN_VERSION {
            return Err(format!(
                "it is NCCL {}; consort needs 2.7 or newer",
                version_string(version)
            ));
        }
        Ok(Nccl {
            path: resolved_path().unwrap_or_else(|| name.to_string()),
            version,
            get_unique_id: sym(&lib, "ncclGetUniqueId")?,
            comm_init_rank: sym(&lib, "ncclCommInitRank")?,
            comm_init_rank_config: opt(
                &lib,
                "ncclCommInitRankConfig",
                version,
                version_code(2, 14, 0),
            ),
            comm_finalize: opt(&lib, "ncclCommFinalize", version, version_code(2, 14, 0)),
            comm_destroy: sym(&lib, "ncclCommDestroy")?,
            comm_abort: sym(&lib, "ncclCommAbort")?,
            comm_get_async_error: sym(&lib, "ncclCommGetAsyncError")?,
            get_error_string: sym(&lib, "ncclGetErrorString")?,
            get_last_error: opt(&lib, "ncclGetLastError", version, version_code(2, 13, 0)),
            group_start: sym(&lib, "ncclGroupStart")?,
            group_end: sym(&lib, "ncclGroupEnd")?,
            all_reduce: sym(&lib, "ncclAllReduce")?,
            broadcast: sym(&lib, "ncclBroadcast")?,
            reduce: sym(&lib, "ncclReduce")?,
            all_gather: sym(&lib, "ncclAllGather")?,
            reduce_scatter: sym(&lib, "ncclReduceScatter")?,
            send: sym(&lib, "ncclSend")?,
            recv: sym(&lib, "ncclRecv")?,
            red_op_create_pre_mul_sum: opt(
                &lib,
                "ncclRedOpCreatePreMulSum",
                version,
                version_code(2, 11, 0),
            ),
            red_op_destroy: opt(&lib, "ncclRedOpDestroy", version, version_code(2, 11, 0)),
            comm_split: opt(&lib, "ncclCommSplit", version, version_code(2, 18, 0)),
            _lib: lib,
        })
    }
}

/// The file the loader mapped for libnccl, from `/proc/self/maps` (Linux),
/// so that messages name the library actually in use.
fn resolved_path() -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            std::path::Path::new(p)
                .file_name()
                .is_some_and(|f| f.to_string_lossy().starts_with("libnccl.so"))
        })
        .map(str::to_string)
}

/// `2.28.3` from a version code.
pub fn version_string(code: i32) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100)
    }
}

impl Nccl {
    /// `2.28.3`.
    pub fn version_string(&self) -> String {
        version_string(self.version)
    }

    /// NCCL's own name for a result code.
    pub fn error_string(&self, code: c_int) -> String {
        // SAFETY: ncclGetErrorString accepts any code and returns a static
        // NUL-terminated string (or null).
        let p = unsafe { (self.get_error_string)(code) };
        if p.is_null() {
            return format!("NCCL result {code}");
        }
        // SAFETY: non-null, NUL-terminated, owned by NCCL for the process.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// `ncclGetUniqueId`.
    pub fn unique_id(&self) -> Result<UniqueId, c_int> {
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid out-pointer of the right layout.
        let r = unsafe { (self.get_unique_id)(&mut id) };
        if r == result::SUCCESS { Ok(id) } else { Err(r) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_follow_nccl_h() {
        assert_eq!(version_code(2, 8, 4), 2804);
        assert_eq!(version_code(2, 28, 3), 22803);
        assert_eq!(version_string(22803), "2.28.3");
        assert_eq!(version_string(2804), "2.8.4");
        assert!(version_code(2, 7, 0) < version_code(2, 9, 0));
    }

    #[test]
    fn a_miss_names_every_candidate_and_why() {
        let e = load_from(&["/nonexistent/libnccl.so.2".into(), "libnope.so.9".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/libnccl.so.2 ("), "{e}");
        assert!(e.contains("libnope.so.9 ("), "{e}");
    }

    #[test]
    fn a_library_that_is_not_nccl_is_refused_by_symbol() {
        // libc is on every Linux machine and has no ncclGetVersion.
        let e = load_from(&["libc.so.6".into()]).unwrap_err().to_string();
        assert!(e.contains("it has no ncclGetVersion"), "{e}");
    }
}
