//! The one error type of the library.
//!
//! Every public function returns `Result<_, Error>`. Each variant names the tensor or option at
//! fault and says what was expected, so that the message alone tells a user what to change.

/// Everything that can go wrong when describing or running attention.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor has the wrong number of dimensions for the chosen layout.
    #[error("`{tensor}` must have {expected} dimensions ({layout}), got {got} (shape {shape:?})")]
    Rank {
        /// Name of the tensor (`q`, `k`, `v`, `out`, ...).
        tensor: &'static str,
        /// Number of dimensions the layout needs.
        expected: usize,
        /// Number of dimensions given.
        got: usize,
        /// The expected layout, e.g. `[b, sq, hq, d]`.
        layout: &'static str,
        /// The shape given.
        shape: Vec<usize>,
    },

    /// Two tensors disagree on a dimension they must share, or a tensor has a size it can't have.
    #[error("shape mismatch: {0}")]
    Shape(String),

    /// The number of query heads is not a multiple of the number of key/value heads.
    #[error("query heads ({hq}) must be a multiple of key/value heads ({hk}) for GQA/MQA")]
    HeadRatio {
        /// Query heads.
        hq: usize,
        /// Key/value heads.
        hk: usize,
    },

    /// A head dimension outside what the backend supports.
    #[error("`{tensor}` head dimension {dim} is not supported by the {backend} backend (supported: {min}..={max})")]
    HeadDim {
        /// Which tensor carries the dimension (`q`/`k` for `d`, `v` for `dv`).
        tensor: &'static str,
        /// The head dimension given.
        dim: usize,
        /// Backend name.
        backend: &'static str,
        /// Smallest supported head dimension.
        min: usize,
        /// Largest supported head dimension.
        max: usize,
    },

    /// The last dimension of a tensor is not contiguous.
    #[error("`{tensor}` must have unit stride in its last dimension, got stride {stride}")]
    InnerStride {
        /// Tensor name.
        tensor: &'static str,
        /// The stride given for the last dimension.
        stride: usize,
    },

    /// A view's shape and strides reach past the end of its buffer.
    #[error("`{tensor}` with shape {shape:?} and strides {strides:?} reaches element {needed}, but its buffer holds only {len} elements")]
    OutOfBounds {
        /// Tensor name.
        tensor: &'static str,
        /// Shape of the view.
        shape: Vec<usize>,
        /// Strides of the view, in elements.
        strides: Vec<usize>,
        /// Number of elements the view needs (largest offset + 1).
        needed: usize,
        /// Length of the buffer.
        len: usize,
    },

    /// The number of strides differs from the number of dimensions.
    #[error("`{tensor}` has {dims} dimensions but {strides} strides")]
    StrideCount {
        /// Tensor name.
        tensor: &'static str,
        /// Number of dimensions.
        dims: usize,
        /// Number of strides.
        strides: usize,
    },

    /// An output view whose strides make two elements share one memory location.
    #[error("`{tensor}` strides {strides:?} for shape {shape:?} make elements overlap; outputs need distinct memory per element")]
    Overlap {
        /// Tensor name.
        tensor: &'static str,
        /// Shape of the view.
        shape: Vec<usize>,
        /// Strides of the view.
        strides: Vec<usize>,
    },

    /// An output buffer whose length does not match what the problem produces.
    #[error("`{tensor}` buffer has {got} elements, expected {expected}")]
    BufferLength {
        /// Tensor name.
        tensor: &'static str,
        /// Number of elements needed.
        expected: usize,
        /// Number of elements given.
        got: usize,
    },

    /// Invalid `cu_seqlens_q` / `cu_seqlens_k`.
    #[error("`{which}` is invalid: {reason}")]
    CuSeqlens {
        /// `cu_seqlens_q` or `cu_seqlens_k`.
        which: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// A window side below -1.
    #[error("window ({left}, {right}) is invalid: each side must be >= 0, or -1 for unbounded")]
    Window {
        /// Left extent.
        left: i64,
        /// Right extent.
        right: i64,
    },

    /// A softmax scale that is NaN or infinite.
    #[error("softmax scale must be finite, got {0}")]
    Scale(f32),

    /// A softcap that is not a positive finite number.
    #[error("softcap must be a positive finite number, got {0}")]
    Softcap(f32),

    /// A block-sparse mask of the wrong shape or with a zero block size.
    #[error("block mask is invalid: {0}")]
    BlockMask(String),

    /// ALiBi slopes of the wrong shape (non-finite slopes propagate like any non-finite input).
    #[error("ALiBi slopes are invalid: {0}")]
    Alibi(String),

    /// A dropout probability outside `[0, 1)`.
    #[error("dropout probability must be in [0, 1), got {0}")]
    Dropout(f32),

    /// An FP8 descale factor that is not a positive finite number.
    #[error("FP8 descale factor of `{tensor}` must be a positive finite number, got {value}")]
    Fp8Scale {
        /// `q`, `k` or `v`.
        tensor: &'static str,
        /// The factor given.
        value: f32,
    },

    /// Inputs of a backward pass that do not belong to the forward pass they claim to follow.
    #[error("backward does not match its forward: {0}")]
    Mismatch(String),

    /// A buffer the call needs could not be allocated.
    #[error("out of memory: `{what}` needs {elements} elements of {element_bytes} bytes")]
    OutOfMemory {
        /// What the buffer is for.
        what: &'static str,
        /// Number of elements requested.
        elements: usize,
        /// Bytes per element.
        element_bytes: usize,
    },

    /// A KV-cache input is inconsistent: `cache_seqlens` past the cache, a block table entry past
    /// the pages, new tokens that do not fit, two sequences writing one slot, ...
    #[error("KV cache: {0}")]
    KvCache(String),

    /// A feature that this backend or build does not provide.
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// The CPU instruction-set path asked for (by `FLASH_ATTN_CPU_ISA` or
    /// [`AttentionSpec::cpu_isa`](crate::AttentionSpec::cpu_isa)) is unknown, or this CPU lacks it.
    #[error("CPU instruction set: {0}")]
    CpuIsa(String),

    /// The CUDA driver library or a usable GPU is missing (CUDA backend).
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(String),

    /// The NVRTC library (run-time compiler of the CUDA backend) could not be loaded.
    #[error("NVRTC is not available: {0}")]
    NvrtcUnavailable(String),

    /// The CUDA headers a kernel needs were not found.
    #[error("CUDA headers not found: {0}")]
    CudaHeaders(String),

    /// NVRTC rejected a kernel; `log` is the compiler's log.
    #[error("NVRTC could not compile kernel `{kernel}`:\n{log}")]
    KernelCompile {
        /// Kernel variant name.
        kernel: String,
        /// NVRTC's program log.
        log: String,
    },

    /// The GPU ran out of memory.
    #[error("out of device memory: {0}")]
    DeviceOutOfMemory(String),

    /// A CUDA driver call or kernel launch failed.
    #[error("CUDA launch failed: {0}")]
    CudaLaunch(String),
}

/// A vector of `n` copies of `value`, or [`Error::OutOfMemory`] instead of an abort.
pub(crate) fn try_vec<T: Clone>(what: &'static str, n: usize, value: T) -> Result<Vec<T>> {
    let oom = || Error::OutOfMemory { what, elements: n, element_bytes: std::mem::size_of::<T>() };
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| oom())?;
    v.resize(n, value);
    Ok(v)
}

/// Product of a shape's dimensions, or [`Error::OutOfMemory`] when it overflows.
pub(crate) fn numel(what: &'static str, shape: &[usize]) -> Result<usize> {
    shape.iter().try_fold(1usize, |a, &n| a.checked_mul(n)).ok_or(Error::OutOfMemory {
        what,
        elements: usize::MAX,
        element_bytes: 1,
    })
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
