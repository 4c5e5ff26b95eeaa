//! A rank's arena (one 64-byte-aligned allocation, made once) and the conversions between
//! arena bytes and [`Tensor`]s.

use half::{bf16, f16};
use hzp_ir::{DType, Data, Tensor, TensorType};
use std::alloc::{alloc_zeroed, dealloc, Layout};

/// Alignment of the arena (and of every planned offset).
pub const ARENA_ALIGN: usize = 64;

/// One rank's memory: `len` bytes, 64-byte aligned, zeroed at creation.
///
/// Several threads (the rank's streams, and other ranks' communicators) access disjoint
/// byte ranges of it at the same time; which ranges may be used together is what a verified
/// plan guarantees. Access is therefore through raw pointers ([`Arena::ptr`]) and the
/// `unsafe` slice accessors, never through a borrow of the whole arena.
pub struct Arena {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the arena is plain memory; concurrent access to disjoint ranges is what the
// executor does, and the plan verifier guarantees disjointness of ranges in concurrent use.
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

impl Arena {
    /// Allocates `len` zeroed bytes (an empty arena allocates nothing).
    pub fn new(len: usize) -> Result<Arena, String> {
        if len == 0 {
            return Ok(Arena {
                ptr: std::ptr::NonNull::<u64>::dangling().as_ptr() as *mut u8,
                len: 0,
            });
        }
        let layout = Layout::from_size_align(len, ARENA_ALIGN)
            .map_err(|_| format!("an arena of {len} bytes is too large"))?;
        // SAFETY: the layout has a nonzero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(format!(
                "cannot allocate the arena: {} ({len} bytes) per rank",
                hzp_ir::format_bytes(len as u64)
            ));
        }
        Ok(Arena { ptr, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Pointer to byte `offset` (in bounds: callers check buffers against the arena size).
    pub fn ptr(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= self.len);
        // SAFETY: offset is within the allocation (or one past its end).
        unsafe { self.ptr.add(offset) }
    }

    /// # Safety
    /// `offset..offset + len` is in bounds and nobody writes it while the slice lives.
    pub unsafe fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        std::slice::from_raw_parts(self.ptr(offset), len)
    }

    /// The `len` bytes at `offset` as f32 elements.
    ///
    /// # Safety
    /// As [`Arena::bytes`]; `offset` is a multiple of 4 and the bytes hold f32 data.
    pub unsafe fn f32s(&self, offset: usize, len: usize) -> &[f32] {
        std::slice::from_raw_parts(self.ptr(offset) as *const f32, len / 4)
    }

    /// The `len` bytes at `offset` as writable f32 elements.
    ///
    /// # Safety
    /// As [`Arena::bytes_mut`]; `offset` is a multiple of 4.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn f32s_mut(&self, offset: usize, len: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.ptr(offset) as *mut f32, len / 4)
    }

    /// # Safety
    /// `offset..offset + len` is in bounds and nobody else accesses it while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr(offset), len)
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `new` with this layout.
            unsafe {
                dealloc(
                    self.ptr,
                    Layout::from_size_align_unchecked(self.len, ARENA_ALIGN),
                )
            };
        }
    }
}

/// The bytes of a tensor's data as stored in an arena (little-endian machines: the native
/// representation; bool as one byte 0/1).
pub fn data_bytes(d: &Data) -> &[u8] {
    fn raw<T>(v: &[T]) -> &[u8] {
        // SAFETY: plain-old-data element types without padding.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
    }
    match d {
        Data::F32(v) => raw(v),
        Data::BF16(v) => raw(v),
        Data::F16(v) => raw(v),
        Data::I64(v) => raw(v),
        Data::I32(v) => raw(v),
        Data::Bool(v) => raw(v),
    }
}

/// A tensor of type `ty` read from arena bytes (`bytes.len()` must be its size).
pub fn tensor_from_bytes(ty: &TensorType, bytes: &[u8]) -> Tensor {
    let n = ty.numel();
    fn read<T: Copy>(bytes: &[u8], n: usize, f: impl Fn(&[u8]) -> T) -> Vec<T> {
        let es = bytes.len() / n.max(1);
        (0..n).map(|i| f(&bytes[i * es..(i + 1) * es])).collect()
    }
    let a2 = |c: &[u8]| [c[0], c[1]];
    let a4 = |c: &[u8]| [c[0], c[1], c[2], c[3]];
    let a8 = |c: &[u8]| [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]];
    let data = match ty.dtype {
        DType::F32 => Data::F32(read(bytes, n, |c| f32::from_ne_bytes(a4(c)))),
        DType::BF16 => Data::BF16(read(bytes, n, |c| {
            bf16::from_bits(u16::from_ne_bytes(a2(c)))
        })),
        DType::F16 => Data::F16(read(bytes, n, |c| {
            f16::from_bits(u16::from_ne_bytes(a2(c)))
        })),
        DType::I64 => Data::I64(read(bytes, n, |c| i64::from_ne_bytes(a8(c)))),
        DType::I32 => Data::I32(read(bytes, n, |c| i32::from_ne_bytes(a4(c)))),
        DType::Bool => Data::Bool(bytes.iter().map(|&b| b != 0).collect()),
    };
    Tensor {
        shape: ty.shape.clone(),
        data,
    }
}

/// Writes a tensor's data into arena bytes of exactly its size.
pub fn write_tensor(t: &Tensor, out: &mut [u8]) -> Result<(), String> {
    let src = data_bytes(&t.data);
    if src.len() != out.len() {
        return Err(format!(
            "internal: a {} result of {} bytes for a buffer of {} bytes",
            t.ty(),
            src.len(),
            out.len()
        ));
    }
    out.copy_from_slice(src);
    Ok(())
}

/// The first element of arena bytes of `dtype`, as f64 (for printing a loss).
pub fn scalar_f64(dtype: DType, bytes: &[u8]) -> Option<f64> {
    let b = bytes.get(..dtype.size_bytes())?;
    Some(match dtype {
        DType::F32 => f32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::BF16 => bf16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f64(),
        DType::F16 => f16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f64(),
        DType::I64 => i64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f64,
        DType::I32 => i32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::Bool => (b[0] != 0) as u8 as f64,
    })
}

/// A typed read-only view of arena bytes holding `dtype` elements.
///
/// # Safety
/// `bytes` starts at an address aligned for `dtype` (arena offsets are multiples of 8) and
/// holds whole elements; bool bytes are 0 or 1 (everything the executor writes is).
pub unsafe fn data_ref(dtype: DType, bytes: &[u8]) -> crate::cpu::DataRef<'_> {
    use crate::cpu::DataRef;
    let n = bytes.len() / dtype.size_bytes();
    let p = bytes.as_ptr();
    match dtype {
        DType::F32 => DataRef::F32(std::slice::from_raw_parts(p as *const f32, n)),
        DType::BF16 => DataRef::BF16(std::slice::from_raw_parts(p as *const bf16, n)),
        DType::F16 => DataRef::F16(std::slice::from_raw_parts(p as *const f16, n)),
        DType::I64 => DataRef::I64(std::slice::from_raw_parts(p as *const i64, n)),
        DType::I32 => DataRef::I32(std::slice::from_raw_parts(p as *const i32, n)),
        DType::Bool => DataRef::Bool(std::slice::from_raw_parts(p as *const bool, n)),
    }
}

/// A typed writable view of arena bytes holding `dtype` elements.
///
/// # Safety
/// As [`data_ref`].
pub unsafe fn data_mut(dtype: DType, bytes: &mut [u8]) -> crate::cpu::DataMut<'_> {
    use crate::cpu::DataMut;
    let n = bytes.len() / dtype.size_bytes();
    let p = bytes.as_mut_ptr();
    match dtype {
        DType::F32 => DataMut::F32(std::slice::from_raw_parts_mut(p as *mut f32, n)),
        DType::BF16 => DataMut::BF16(std::slice::from_raw_parts_mut(p as *mut bf16, n)),
        DType::F16 => DataMut::F16(std::slice::from_raw_parts_mut(p as *mut f16, n)),
        DType::I64 => DataMut::I64(std::slice::from_raw_parts_mut(p as *mut i64, n)),
        DType::I32 => DataMut::I32(std::slice::from_raw_parts_mut(p as *mut i32, n)),
        DType::Bool => DataMut::Bool(std::slice::from_raw_parts_mut(p as *mut bool, n)),
    }
}
