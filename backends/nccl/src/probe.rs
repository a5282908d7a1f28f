//! Finding libcuda and libnccl before the first CUDA or NCCL call.
//!
//! cudarc loads both libraries lazily and panics when one is missing, so
//! this module tries the same file names with `dlopen` first and turns a
//! miss into `BackendUnavailable`, saying what was searched and what to
//! install.

use consort_comm::CommError;

/// What to do about a missing libcuda.
const CUDA_FIX: &str = "install the NVIDIA driver (it provides libcuda.so.1); in a container, \
                        start it with the NVIDIA container toolkit (`docker run --gpus all`)";

/// What to do about a missing libnccl.
const NCCL_FIX: &str = "install NCCL: the libnccl2 package (`apt install libnccl2`), or the \
                        nvidia-nccl-cu12 wheel (`pip install nvidia-nccl-cu12`) with its lib \
                        directory on LD_LIBRARY_PATH (`python -c \"import nvidia.nccl, os; \
                        print(os.path.dirname(nvidia.nccl.__file__) + '/lib')\"`)";

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

/// Checks that the CUDA driver library and NCCL can be loaded under the
/// names cudarc will use. Never panics.
pub fn probe() -> Result<(), CommError> {
    let names = |lib: &str| {
        let mut seen = std::collections::HashSet::new();
        let mut v = cudarc::get_lib_name_candidates(lib);
        v.retain(|n| seen.insert(n.clone()));
        v
    };
    probe_with(&names("cuda"), &names("nccl"))
}

/// [`probe`] with explicit candidate names (tests use names that exist
/// nowhere).
pub fn probe_with(cuda: &[String], nccl: &[String]) -> Result<(), CommError> {
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    for (what, names, fix) in [
        ("the CUDA driver library", cuda, CUDA_FIX),
        ("the NCCL library", nccl, NCCL_FIX),
    ] {
        if !loads(names) {
            return Err(unavailable(format!(
                "{what} was not found: tried {names:?} on the loader's path \
                 (LD_LIBRARY_PATH={path:?}). To fix: {fix}. Without a GPU, use the tcp or sim \
                 backend"
            )));
        }
    }
    Ok(())
}

/// Checks the libraries, then that the machine has a GPU `device`.
pub fn probe_device(device: usize) -> Result<(), CommError> {
    probe()?;
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
