//! A rank's arena (one 64-byte-aligned allocation, made once) and typed views of its bytes
//! (the conversions between arena bytes and [`Tensor`]s are the executor contract's,
//! [`crate::executor::bytes`], re-exported here).

pub use crate::executor::bytes::{data_bytes, scalar_f64, tensor_from_bytes, write_tensor};
use half::{bf16, f16};
use hzp_ir::DType;
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
