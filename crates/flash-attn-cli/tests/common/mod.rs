//! Fixtures shared by the CLI's integration tests: a temporary directory, safetensors inputs
//! written from typed values, and outputs read back.

// Each test crate uses a different subset of these helpers.
#![allow(dead_code)]

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use flash_attn::check::Rng;
use flash_attn::Element;
use half::{bf16, f16};
use safetensors::{Dtype, View};

/// A fresh directory under the system temp dir, removed when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("flash-attn-cli-{}-{n}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }

    /// File names in the directory, sorted.
    pub fn files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .expect("read temp dir")
            .map(|e| e.expect("dir entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A tensor to write: dtype, shape and little-endian bytes.
#[derive(Clone)]
pub struct Raw {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl View for &Raw {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Element types the tests write and read.
pub trait Le: Copy {
    const ST_DTYPE: Dtype;
    fn bytes(self) -> Vec<u8>;
    fn read(b: &[u8]) -> Self;
}

macro_rules! le {
    ($t:ty, $d:expr) => {
        impl Le for $t {
            const ST_DTYPE: Dtype = $d;
            fn bytes(self) -> Vec<u8> {
                self.to_le_bytes().to_vec()
            }
            fn read(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("element width"))
            }
        }
    };
}
le!(f32, Dtype::F32);
le!(f16, Dtype::F16);
le!(bf16, Dtype::BF16);
le!(i32, Dtype::I32);
le!(i64, Dtype::I64);
le!(u8, Dtype::U8);

pub fn raw<T: Le>(values: &[T], shape: &[usize]) -> Raw {
    Raw { dtype: T::ST_DTYPE, shape: shape.to_vec(), bytes: values.iter().flat_map(|x| x.bytes()).collect() }
}

pub fn decode<T: Le>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(std::mem::size_of::<T>()).map(T::read).collect()
}

pub fn normal<T: Element>(rng: &mut Rng, shape: &[usize]) -> Vec<T> {
    (0..shape.iter().product::<usize>()).map(|_| T::from_f64(rng.normal())).collect()
}

pub fn save(path: &Path, tensors: &[(&str, Raw)]) {
    let bytes = safetensors::serialize(tensors.iter().map(|(n, t)| (*n, t)), &None).expect("serialize");
    std::fs::write(path, bytes).expect("write input");
}
