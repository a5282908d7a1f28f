//! CUDA C++ compiled at run time for the GPU at hand ([`compile`], NVRTC
//! loaded at run time like the driver), the check that a CUDA library can
//! be loaded ([`probe_lib`]), and launching a 1-D kernel ([`launch_1d`]).
//! Everything CUDA that consort's kernels need, in the crate that owns the
//! device; the kernels themselves (the sharded optimizers', the trainer's)
//! live with what they compute.

use std::ffi::c_void;

use cudarc::driver::{CudaFunction, CudaModule, DriverError, result as cu, sys as cusys};
use std::sync::Arc;

use super::CudaDevice;

/// Checks that the CUDA library `name` (cudarc's name: `"nvrtc"`,
/// `"cublas"`) can be loaded; the error says where to find it.
pub fn probe_lib(name: &str, what: &str) -> Result<(), String> {
    let names = crate::probe::lib_candidates(name);
    let loads = |n: &String| {
        // SAFETY: loading the vendor library cudarc is about to load anyway.
        unsafe { libloading::Library::new(n) }.is_ok()
    };
    if names.iter().any(loads) {
        return Ok(());
    }
    Err(format!(
        "{what} was not found (tried {names:?}); put the CUDA toolkit's lib64, or PyTorch's \
         nvidia/*/lib directories, on LD_LIBRARY_PATH"
    ))
}

/// Compiles CUDA C++ `src` with NVRTC to a CUBIN for `dev`'s architecture
/// (the driver then never JITs PTX that may be newer than it: NVRTC from a
/// pip wheel often is), falling back to PTX where this NVRTC does not know
/// the architecture, and loads it. `options` go to NVRTC beside the
/// architecture; `what` names the kernels in errors.
pub fn compile(
    dev: &CudaDevice,
    src: &str,
    options: &[&str],
    what: &str,
) -> Result<Arc<CudaModule>, String> {
    use cudarc::nvrtc::{Ptx, result as rtc, sys as rtc_sys};
    probe_lib("nvrtc", "NVRTC (the CUDA run-time compiler)")?;
    let (major, minor) = dev
        .context()
        .compute_capability()
        .map_err(|e| format!("{what}: {e:?}"))?;
    let c_src = std::ffi::CString::new(src).map_err(|e| format!("{what}: {e}"))?;
    let prog = rtc::create_program(&c_src, None).map_err(|e| format!("NVRTC: {e:?}"))?;
    let mut opts = vec![format!("--gpu-architecture=sm_{major}{minor}")];
    opts.extend(options.iter().map(|o| o.to_string()));
    // SAFETY: `prog` is live until destroyed at the end of this block; the
    // CUBIN buffer has the size NVRTC reports.
    let cubin = unsafe {
        let built = rtc::compile_program(prog, &opts).and_then(|()| {
            let mut n = 0usize;
            rtc_sys::nvrtcGetCUBINSize(prog, &mut n).result()?;
            let mut buf = vec![0 as std::ffi::c_char; n];
            rtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr()).result()?;
            Ok(buf.into_iter().map(|c| c as u8).collect::<Vec<u8>>())
        });
        let log = rtc::get_program_log(prog)
            .map(|l| l.into_iter().map(|c| c as u8 as char).collect::<String>())
            .unwrap_or_default();
        let _ = rtc::destroy_program(prog);
        built.map_err(|e| format!("NVRTC {opts:?}: {e:?} {log}"))
    };
    let image = match cubin {
        Ok(c) if !c.is_empty() => Ptx::from_binary(c),
        other => {
            tracing::warn!("no CUBIN for sm_{major}{minor} ({other:?}); loading PTX instead");
            let ptx_opts = cudarc::nvrtc::CompileOptions {
                options: options.iter().map(|o| o.to_string()).collect(),
                ..Default::default()
            };
            cudarc::nvrtc::compile_ptx_with_opts(src, ptx_opts)
                .map_err(|e| format!("NVRTC: {e:?}"))?
        }
    };
    dev.context().load_module(image).map_err(|e| {
        format!(
            "loading {what}: {e:?} (CUDA_ERROR_UNSUPPORTED_PTX_VERSION means NVRTC is newer than \
             the driver: update the driver, or put an older NVRTC first on LD_LIBRARY_PATH)"
        )
    })
}

/// Launches `f` as a 1-D grid-stride kernel over `len` elements on
/// `stream` of `dev`: blocks of 256 threads, at most 4,096 blocks.
///
/// # Safety
/// `args` point at values of `f`'s parameter types, alive until this
/// returns (the driver copies them at launch), and every address among
/// them is live device memory of `dev` that the kernel may touch.
pub unsafe fn launch_1d(
    dev: &CudaDevice,
    f: &CudaFunction,
    (stream, len): (u64, usize),
    args: &mut [*mut c_void],
) -> Result<(), DriverError> {
    let blocks = len.div_ceil(256).clamp(1, 4096) as u32;
    dev.context().bind_to_thread()?;
    // SAFETY: the caller's contract.
    unsafe {
        cu::launch_kernel(
            f.cu_function(),
            (blocks, 1, 1),
            (256, 1, 1),
            0,
            stream as cusys::CUstream,
            args,
        )
    }
}
