//! Finding libcuda and libnccl before the first CUDA or NCCL call.
//!
//! cudarc loads the CUDA driver lazily and panics when it is missing, so
//! this module tries the same file names with `dlopen` first and turns a
//! miss into `BackendUnavailable`, saying what was searched and what to
//! install. NCCL is opened by [`crate::sys`]; a miss there becomes the same
//! kind of error, listing every name and path tried.

use std::sync::Arc;

use consort_comm::CommError;

use crate::sys::{self, Nccl};

/// What to do about a missing libcuda.
const CUDA_FIX: &str = "install the NVIDIA driver (it provides libcuda.so.1); in a container, \
                        start it with the NVIDIA container toolkit (`docker run --gpus all`)";

/// What to do about a missing libnccl.
const NCCL_FIX: &str = "point CONSORT_NCCL_LIBRARY at a libnccl.so.2, or put its directory on \
                        LD_LIBRARY_PATH. PyTorch's pip wheel has one: `python -c \"import \
                        nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) + '/lib')\"` \
                        (or `pip install nvidia-nccl-cu12`); on Debian and Ubuntu, `apt install \
                        libnccl2`";

fn unavailable(reason: String) -> CommError {
    CommError::BackendUnavailable {
        backend: "nccl".into(),
        reason,
    }
}

/// Whether any of `names` loads.
fn loads(names: &[String]) -> bool {
    names.iter().any(|n| {
        // SAFETY: loading a shared library runs its initialisers; these are
        // the vendor libraries cudarc itself would load next.
        unsafe { libloading::Library::new(n) }.is_ok()
    })
}

/// The file names cudarc's loader tries for CUDA library `name` (`"cuda"`,
/// `"nvrtc"`, `"cublas"`) on Linux, in its order, for the CUDA 12.8
/// bindings consort builds cudarc with (feature `cuda-12080`): a probe that
/// found a name cudarc never tries (`libnvrtc.so.13`, say) would pass and
/// cudarc would then panic. (cudarc lists them itself only when it loads
/// at run time; with candle's CUDA it links instead, and the loader finds
/// the libraries before `main`.)
pub fn lib_candidates(name: &str) -> Vec<String> {
    use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};
    let mut v = vec![format!("{DLL_PREFIX}{name}{DLL_SUFFIX}")];
    for version in ["12", "11", "10", "9", "1"] {
        v.push(format!("{DLL_PREFIX}{name}{DLL_SUFFIX}.{version}"));
    }
    v
}

/// The CUDA driver's candidate names.
fn cuda_names() -> Vec<String> {
    lib_candidates("cuda")
}

/// Opens NCCL (once per process), or says why it cannot.
pub fn load_nccl() -> Result<Arc<Nccl>, CommError> {
    sys::load().map_err(|e| nccl_unavailable(&e))
}

fn nccl_unavailable(e: &sys::LoadError) -> CommError {
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    unavailable(format!(
        "the NCCL library was not found: {e} (LD_LIBRARY_PATH={path:?}). To fix: {NCCL_FIX}. \
         Without a GPU, use the tcp or sim backend"
    ))
}

/// Checks that the CUDA driver library and NCCL can be loaded. Never
/// panics.
pub fn probe() -> Result<(), CommError> {
    probe_with(&cuda_names(), &sys::candidates())
}

/// [`probe`] with explicit candidate names (tests use names that exist
/// nowhere).
pub fn probe_with(cuda: &[String], nccl: &[String]) -> Result<(), CommError> {
    if !loads(cuda) {
        let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        return Err(unavailable(format!(
            "the CUDA driver library was not found: tried {cuda:?} on the loader's path \
             (LD_LIBRARY_PATH={path:?}). To fix: {CUDA_FIX}. Without a GPU, use the tcp or sim \
             backend"
        )));
    }
    sys::load_from(nccl)
        .map(|_| ())
        .map_err(|e| nccl_unavailable(&e))
}

/// Checks the CUDA driver, then that the machine has a GPU `device`.
pub fn probe_device(device: usize) -> Result<(), CommError> {
    let names = cuda_names();
    if !loads(&names) {
        return probe_with(&names, &[]);
    }
    let driver = |e: cudarc::driver::DriverError| {
        unavailable(format!(
            "the CUDA driver loads but does not work ({e:?}); check `nvidia-smi`"
        ))
    };
    cudarc::driver::result::init().map_err(driver)?;
    let count = cudarc::driver::result::device::get_count().map_err(driver)?;
    if device >= count.max(0) as usize {
        return Err(unavailable(format!(
            "GPU {device} was asked for, but this machine has {count} (CUDA_VISIBLE_DEVICES={:?}); \
             run one process per GPU with LOCAL_RANK below the GPU count",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default()
        )));
    }
    Ok(())
}
