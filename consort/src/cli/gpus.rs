//! Counting the CUDA GPUs this process can see, for `consort run
//! --nproc-per-node gpu|auto`.
//!
//! This module owns loading the CUDA driver library (libcuda) at run time
//! with `libloading`, so the binary builds and runs where no CUDA toolkit
//! or driver is installed, and the "no GPU" error message that says what
//! was checked and what to do. Nothing here panics: every failure (the
//! library or a symbol missing, a non-zero `CUresult`) counts as no GPU,
//! with the reason kept for the message.

use std::ffi::{CStr, c_char, c_int, c_uint};

use libloading::Library;

/// The CUDA driver library's names, tried in this order.
pub(crate) const LIBCUDA: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// `CUresult cuInit(unsigned int Flags)`.
type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
/// `CUresult cuDeviceGetCount(int *count)`.
type CuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> c_int;
/// `CUresult cuGetErrorName(CUresult error, const char **pStr)`.
type CuGetErrorName = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;

/// The number of CUDA GPUs the driver reports (`cuInit(0)`, then
/// `cuDeviceGetCount`): `Ok(n)` with `n >= 1`, or `Err(why there are
/// none)`. The driver applies CUDA_VISIBLE_DEVICES itself, so the count
/// already reflects it (an empty value hides every GPU).
pub(crate) fn cuda_device_count() -> Result<usize, String> {
    count_with(&LIBCUDA)
}

/// [`cuda_device_count`] with explicit library names (tests use names
/// that exist nowhere).
fn count_with(names: &[&str]) -> Result<usize, String> {
    let lib = load(names)?;
    let count = query(&lib);
    // Left loaded on purpose: unloading libcuda after cuInit can crash at
    // exit (its atexit handlers would point into unmapped code).
    std::mem::forget(lib);
    match count? {
        0 => Err("cuDeviceGetCount reported 0 devices".into()),
        n => Ok(n),
    }
}

/// The first of `names` that loads, or why none did.
fn load(names: &[&str]) -> Result<Library, String> {
    let mut tried = Vec::with_capacity(names.len());
    for name in names {
        // SAFETY: loading a shared library runs its initialisers; these
        // are the NVIDIA driver's names, the library torch and cudarc load.
        match unsafe { Library::new(name) } {
            Ok(lib) => return Ok(lib),
            Err(e) => tried.push(e.to_string()),
        }
    }
    Err(format!(
        "libcuda could not be loaded ({})",
        tried.join("; ")
    ))
}

/// `cuInit(0)`, then `cuDeviceGetCount`.
fn query(lib: &Library) -> Result<usize, String> {
    let missing = |sym: &str, e: libloading::Error| format!("libcuda has no {sym}: {e}");
    // SAFETY: `CuInit` is cuInit's signature in cuda.h.
    let init = unsafe { lib.get::<CuInit>(b"cuInit\0") }.map_err(|e| missing("cuInit", e))?;
    // SAFETY: `CuDeviceGetCount` is cuDeviceGetCount's signature in cuda.h.
    let get_count = unsafe { lib.get::<CuDeviceGetCount>(b"cuDeviceGetCount\0") }
        .map_err(|e| missing("cuDeviceGetCount", e))?;
    // SAFETY: cuInit takes no pointers; 0 is its only valid flag value.
    let r = unsafe { init(0) };
    if r != 0 {
        return Err(format!("cuInit(0) failed with {}", result_name(lib, r)));
    }
    let mut n: c_int = 0;
    // SAFETY: called after a successful cuInit, with a valid pointer to
    // an int the driver writes the count into.
    let r = unsafe { get_count(&mut n) };
    if r != 0 {
        return Err(format!(
            "cuDeviceGetCount failed with {}",
            result_name(lib, r)
        ));
    }
    usize::try_from(n).map_err(|_| format!("cuDeviceGetCount reported {n} devices"))
}

/// A `CUresult` as `NAME (code)`, named by the driver's `cuGetErrorName`
/// where it has one.
fn result_name(lib: &Library, r: c_int) -> String {
    // SAFETY: `CuGetErrorName` is cuGetErrorName's signature in cuda.h.
    let name = unsafe { lib.get::<CuGetErrorName>(b"cuGetErrorName\0") }
        .ok()
        .and_then(|f| {
            let mut p: *const c_char = std::ptr::null();
            // SAFETY: `p` is a valid place for the driver to store a
            // pointer to its static, NUL-terminated name of `r`.
            let ok = unsafe { f(r, &mut p) } == 0 && !p.is_null();
            // SAFETY: on success `p` points to that static C string.
            ok.then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        });
    match name {
        Some(n) => format!("{n} ({r})"),
        None => format!("CUresult {r}"),
    }
}

/// CUDA_VISIBLE_DEVICES as the messages show it.
pub(crate) fn visible_devices() -> String {
    match std::env::var_os("CUDA_VISIBLE_DEVICES") {
        None => "unset".into(),
        Some(v) if v.is_empty() => "\"\" (empty: it hides every GPU)".into(),
        Some(v) => format!("{:?}", v.to_string_lossy()),
    }
}

/// The error for `--nproc-per-node gpu` when no GPU was found: what was
/// checked (`why`, from [`cuda_device_count`], and CUDA_VISIBLE_DEVICES)
/// and what to do.
pub(crate) fn no_gpu_message(why: &str) -> String {
    format!(
        "--nproc-per-node gpu: no CUDA GPU was found. Checked the CUDA driver library ({}) \
         and its device count (cuInit, cuDeviceGetCount): {why}; CUDA_VISIBLE_DEVICES is {}. \
         To fix: use `--nproc-per-node cpu` (one worker per CPU) or a number of workers \
         (`--nproc-per-node 4`), or install the NVIDIA driver (it provides libcuda.so.1; in a \
         container, start it with the NVIDIA container toolkit, `docker run --gpus all`)",
        LIBCUDA.join(", then "),
        visible_devices()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_driver_is_no_gpu_with_the_reason() {
        let why = count_with(&["libconsort-no-such-cuda.so.1"]).unwrap_err();
        assert!(
            why.contains("could not be loaded") && why.contains("libconsort-no-such-cuda.so.1"),
            "{why}"
        );
        let msg = no_gpu_message(&why);
        assert!(msg.contains("no CUDA GPU was found"), "{msg}");
        assert!(msg.contains("CUDA_VISIBLE_DEVICES is"), "{msg}");
        assert!(msg.contains("--nproc-per-node cpu"), "{msg}");
    }

    #[test]
    fn counting_never_panics() {
        // Whatever this machine has: a count of at least 1, or a reason.
        match cuda_device_count() {
            Ok(n) => assert!(n >= 1),
            Err(why) => assert!(!why.is_empty()),
        }
    }
}
