//! Tensors in and out of safetensors files.
//!
//! Reading copies each tensor into a typed `Vec` with `from_le_bytes` (the data of a safetensors
//! file carries no alignment guarantee). Writing goes to a temporary file next to the target and
//! is renamed over it only once everything is written, so a failed run never touches the output.

use std::borrow::Cow;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};

use flash_attn::Fp8E4m3;
use half::{bf16, f16};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensorError, SafeTensors, View};

use crate::{CliError, Result};

/// A scalar type stored little-endian in a safetensors file.
pub trait LeScalar: Copy {
    /// The safetensors dtype tag.
    const DTYPE: Dtype;
    /// Bytes per element.
    const SIZE: usize;
    /// Decodes one element from exactly [`Self::SIZE`] bytes.
    fn read_le(bytes: &[u8]) -> Self;
    /// Appends the element's little-endian bytes.
    fn write_le(self, out: &mut Vec<u8>);
}

macro_rules! le_scalar {
    ($t:ty, $dtype:expr, $n:literal) => {
        impl LeScalar for $t {
            const DTYPE: Dtype = $dtype;
            const SIZE: usize = $n;
            fn read_le(bytes: &[u8]) -> Self {
                let mut raw = [0u8; $n];
                raw.copy_from_slice(bytes);
                <$t>::from_le_bytes(raw)
            }
            fn write_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
        }
    };
}

le_scalar!(f32, Dtype::F32, 4);
le_scalar!(f16, Dtype::F16, 2);
le_scalar!(bf16, Dtype::BF16, 2);
le_scalar!(i32, Dtype::I32, 4);
le_scalar!(u8, Dtype::U8, 1);

/// FP8 e4m3 inputs: safetensors' `F8_E4M3` is PyTorch's `float8_e4m3fn`, the format of
/// [`Fp8E4m3`], one byte an element.
impl LeScalar for Fp8E4m3 {
    const DTYPE: Dtype = Dtype::F8_E4M3;
    const SIZE: usize = 1;
    fn read_le(bytes: &[u8]) -> Self {
        Fp8E4m3::from_bits(bytes[0])
    }
    fn write_le(self, out: &mut Vec<u8>) {
        out.push(self.to_bits());
    }
}

/// Reads a whole file into memory.
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| CliError::new(format!("cannot read `{}`: {e}", path.display())))
}

/// A parsed safetensors file and its path (for messages).
pub struct Input<'a> {
    tensors: SafeTensors<'a>,
    path: &'a Path,
}

impl<'a> Input<'a> {
    /// Parses the bytes of a safetensors file, checking its header and that the declared tensors
    /// exactly cover the data (so truncated or padded files are rejected here).
    pub fn parse(bytes: &'a [u8], path: &'a Path) -> Result<Self> {
        let tensors = SafeTensors::deserialize(bytes)
            .map_err(|e| CliError::new(format!("cannot read `{}` as safetensors: {}", path.display(), describe(&e))))?;
        Ok(Self { tensors, path })
    }

    /// The tensor `name`, if the file has it.
    pub fn get(&self, name: &str) -> Result<Option<TensorView<'a>>> {
        match self.tensors.tensor(name) {
            Ok(t) => Ok(Some(t)),
            Err(SafeTensorError::TensorNotFound(_)) => Ok(None),
            Err(e) => Err(CliError::new(format!(
                "cannot read tensor `{name}` of `{}`: {}",
                self.path.display(),
                describe(&e)
            ))),
        }
    }

    /// The tensor `name`, which the file must have.
    pub fn require(&self, name: &str) -> Result<TensorView<'a>> {
        self.get(name)?.ok_or_else(|| {
            let mut names = self.tensors.names();
            names.sort();
            let names: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
            let have = if names.is_empty() { "no tensors".to_owned() } else { names.join(", ") };
            CliError::new(format!("`{}` has no tensor `{name}` (it holds {have})", self.path.display()))
        })
    }
}

/// A readable account of a safetensors error (the crate's own `Display` is its `Debug`).
fn describe(e: &SafeTensorError) -> String {
    match e {
        SafeTensorError::IoError(io) => io.to_string(),
        SafeTensorError::HeaderTooSmall | SafeTensorError::InvalidHeaderLength => {
            "the file is too short for its header (truncated, or not a safetensors file)".into()
        }
        SafeTensorError::HeaderTooLarge => "the header length is implausibly large (not a safetensors file?)".into(),
        SafeTensorError::InvalidHeader
        | SafeTensorError::InvalidHeaderStart
        | SafeTensorError::InvalidHeaderDeserialization
        | SafeTensorError::JsonError(_) => "the header is not valid safetensors JSON (corrupt file?)".into(),
        SafeTensorError::MetadataIncompleteBuffer => {
            "the tensor data does not match the file size (truncated or corrupt file)".into()
        }
        SafeTensorError::TensorInvalidInfo => {
            "a tensor's byte range does not match its shape and dtype (corrupt file)".into()
        }
        SafeTensorError::InvalidOffset(name) => format!("tensor `{name}` has invalid data offsets (corrupt file)"),
        SafeTensorError::ValidationOverflow => "a tensor's declared size overflows (corrupt file)".into(),
        SafeTensorError::TensorNotFound(name) => format!("no tensor `{name}`"),
        SafeTensorError::InvalidTensorView(dtype, shape, len) => {
            format!("{len} bytes cannot hold a {dtype:?} tensor of shape {shape:?}")
        }
    }
}

/// Copies the data of `view` into a `Vec<T>`; its dtype must be `T`'s.
pub fn decode<T: LeScalar>(name: &str, view: &TensorView<'_>) -> Result<Vec<T>> {
    if view.dtype() != T::DTYPE {
        return Err(CliError::new(format!("`{name}` must be {:?}, got {:?}", T::DTYPE, view.dtype())));
    }
    decode_bytes(name, view)
}

/// Copies the data of `view` as `T` whatever its tag says (for same-width reinterpretations such
/// as `BOOL` as `u8`); the caller has checked the dtype.
pub fn decode_bytes<T: LeScalar>(name: &str, view: &TensorView<'_>) -> Result<Vec<T>> {
    let data = view.data();
    let elements = view.shape().iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    if view.dtype().size() != T::SIZE || elements.and_then(|n| n.checked_mul(T::SIZE)) != Some(data.len()) {
        return Err(CliError::new(format!(
            "`{name}` holds {} bytes, which does not match its shape {:?} and dtype {:?}",
            data.len(),
            view.shape(),
            view.dtype()
        )));
    }
    Ok(data.chunks_exact(T::SIZE).map(T::read_le).collect())
}

/// A tensor owned in memory, ready to serialise.
pub struct OwnedTensor {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl OwnedTensor {
    /// Encodes `values` (row-major, `shape`) little-endian.
    pub fn encode<T: LeScalar>(values: &[T], shape: &[usize]) -> Self {
        let mut data = Vec::with_capacity(values.len() * T::SIZE);
        for &x in values {
            x.write_le(&mut data);
        }
        Self { dtype: T::DTYPE, shape: shape.to_vec(), data }
    }
}

impl View for &OwnedTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes `tensors` to `path` atomically: into a fresh temporary file in the same directory,
/// then renamed over `path`. On any failure the temporary file is removed and `path` is left as it
/// was.
pub fn write_atomically(path: &Path, tensors: &[(&str, OwnedTensor)]) -> Result<()> {
    let fail = |what: String| CliError::new(format!("cannot write `{}`: {what}", path.display()));
    let bytes =
        safetensors::serialize(tensors.iter().map(|(name, t)| (*name, t)), &None).map_err(|e| fail(describe(&e)))?;
    let tmp = temp_path(path).ok_or_else(|| fail("the path has no file name".into()))?;
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .and_then(|mut f| f.write_all(&bytes).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(fail(e.to_string()));
    }
    Ok(())
}

/// `.NAME.PID-NANOS.tmp` next to `path`.
fn temp_path(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?.to_string_lossy();
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    Some(path.with_file_name(format!(".{name}.{}-{nanos}.tmp", std::process::id())))
}
