//! A stand-in for `cubecl-llvm` 0.11.3 with no LLVM: exactly the items
//! `cubecl-cuda` 0.11.3 names, with the real crate's signatures.
//!
//! This crate owns nothing that runs on a GPU. cubecl-cuda always compiles
//! both kernel backends and lets its `cpp` feature (cubecl's `cuda-cpp`)
//! pick CUDA C++ through NVRTC as [`CudaBackend::default`]; with that
//! feature on, the LLVM items here are named but never used. Were the LLVM
//! backend asked for anyway (`CudaCompiler::new(CudaBackend::Llvm)`), its
//! compile returns an error that says why, never a panic.
//!
//! [`CudaBackend::default`]: https://docs.rs/cubecl-cuda/0.11.3/cubecl_cuda/compiler/enum.CudaBackend.html

use cubecl_environment::backtrace::BackTrace;
use cubecl_ir::nvidia::SmArch;
use cubecl_runtime::{
    compiler::{CompilationError, Compiler},
    kernel::{BufferIOAttr, KernelDefinition},
};

/// The NVPTX items cubecl-cuda names.
pub mod nvptx {
    /// The PTX ISA version for a driver, as in the real crate.
    pub mod ptx_version {
        use core::fmt;

        /// A PTX ISA version, as the NVPTX target feature spells it: 8.7
        /// is `87`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct PtxVersion(u32);

        impl PtxVersion {
            /// The newest version a driver of CUDA `driver` loads
            /// (`cuDriverGetVersion`: 12.8 is `12080`); `None` below 10.0.
            /// cubecl-cuda keys its kernel cache by it, so it matches the
            /// real table.
            pub fn for_driver(driver: i32) -> Option<Self> {
                DRIVER_PTX
                    .iter()
                    .find(|(first, _)| driver >= *first)
                    .map(|(_, ptx)| Self(*ptx))
            }
        }

        impl fmt::Display for PtxVersion {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "ptx{}", self.0)
            }
        }

        /// The first CUDA release to load each PTX version, newest first
        /// (the real crate's table).
        const DRIVER_PTX: &[(i32, u32)] = &[
            (13030, 93),
            (13020, 92),
            (13010, 91),
            (13000, 90),
            (12090, 88),
            (12080, 87),
            (12050, 85),
            (12040, 84),
            (12030, 83),
            (12020, 82),
            (12010, 81),
            (12000, 80),
            (11080, 78),
            (11070, 77),
            (11060, 76),
            (11050, 75),
            (11040, 74),
            (11030, 73),
            (11020, 72),
            (11010, 71),
            (11000, 70),
            (10020, 65),
            (10010, 64),
            (10000, 63),
        ];
    }
}

/// The shared items cubecl-cuda names.
pub mod shared {
    /// Device features narrowed to what the LLVM backend lowers.
    pub mod lowered_features {
        use cubecl_ir::DeviceProperties;

        /// The GPU target a device's features are narrowed for.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum GpuTarget {
            /// NVIDIA's PTX.
            Nvptx,
        }

        /// Leaves `props` as they are: cubecl-cuda calls this only when the
        /// LLVM backend compiles, which with the stand-in never happens (its
        /// compile refuses every kernel).
        pub fn restrict_features(_props: &mut DeviceProperties, _target: GpuTarget) {}
    }
}

/// The LLVM target a [`PlironCompiler`] emits for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LlvmTarget {
    /// The host CPU (JIT).
    #[default]
    Cpu,
    /// NVIDIA's PTX.
    Nvptx,
}

/// The options the real compiler reads; here they are only carried.
#[derive(Clone, Debug, Default)]
pub struct PlironOptions {
    /// AMDGPU architecture; never set by cubecl-cuda.
    pub arch: Option<()>,
    /// The NVIDIA architecture.
    pub sm_arch: Option<SmArch>,
    /// The PTX version to emit.
    pub ptx_version: Option<nvptx::ptx_version::PtxVersion>,
    /// Whether scalars go in the kernel parameter block.
    pub grid_constants: bool,
}

/// A compiled PTX module, as the real crate gives it.
#[derive(Clone, Debug)]
pub struct NvptxModule {
    /// NUL-terminated PTX assembly.
    pub ptx: Vec<core::ffi::c_char>,
    /// Kernel entry point symbol.
    pub entrypoint: String,
    /// IR for logging and cache keys.
    pub ir: String,
    /// Shared memory required per launch, in bytes.
    pub shared_memory_size: usize,
    /// Buffer access modes in binding order.
    pub io: Vec<BufferIOAttr>,
}

/// What a compile gives. The stand-in never makes one.
#[derive(Clone, Debug)]
pub enum PlironArtifact {
    /// A PTX module.
    NvptxCode(NvptxModule),
}

impl core::fmt::Display for PlironArtifact {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            PlironArtifact::NvptxCode(m) => f.write_str(&m.ir),
        }
    }
}

/// The LLVM kernel compiler; without LLVM it refuses every kernel.
#[derive(Clone, Debug, Default)]
pub struct PlironCompiler {
    /// What it would emit for.
    pub target: LlvmTarget,
}

impl Compiler for PlironCompiler {
    type Representation = PlironArtifact;
    type CompilationOptions = PlironOptions;

    fn compile(
        &mut self,
        _kernel: KernelDefinition,
        _options: &Self::CompilationOptions,
    ) -> Result<Self::Representation, CompilationError> {
        Err(CompilationError::Generic {
            reason: "this build of cubecl-llvm is consort's stand-in, without LLVM; build \
                     cubecl with its `cuda-cpp` feature (kernels through NVRTC), or without \
                     the stand-in's [patch] to use the LLVM backend"
                .to_string(),
            backtrace: BackTrace::capture(),
        })
    }

    fn extension(&self) -> &'static str {
        match self.target {
            LlvmTarget::Cpu => "plir",
            LlvmTarget::Nvptx => "ll",
        }
    }

    fn lang_tag(&self) -> &'static str {
        match self.target {
            LlvmTarget::Cpu => "mlir",
            LlvmTarget::Nvptx => "llvm",
        }
    }
}
