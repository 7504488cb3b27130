//! Large f32 buffers backed by transparent huge pages where the kernel allows it (Linux
//! `MADV_HUGEPAGE`; THP in `madvise` mode is the common default). Buffers that are streamed
//! again and again (weights, the KV cache) then cost one TLB entry per 2 MiB instead of one per
//! 4 KiB, and a freshly allocated gigabyte costs far less to fault in. Owns nothing else.

/// Asks for transparent huge pages on the whole pages inside `bytes` (a no-op below 4 MiB, off
/// Linux, or where THP is off: the contents never change).
pub fn advise_huge(bytes: &mut [u8]) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        if bytes.len() < (4 << 20) {
            return;
        }
        let start = (bytes.as_mut_ptr() as usize).next_multiple_of(PAGE);
        let end = (bytes.as_mut_ptr() as usize + bytes.len()) & !(PAGE - 1);
        // SAFETY: the range lies inside memory we own; MADV_HUGEPAGE only changes how the
        // kernel backs it and never its contents. Failure (no THP) is harmless.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}

/// `data` as bytes (checksums, copies).
pub fn f32_bytes(data: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern of it is readable as u8; the length is
    // the same allocation's size in bytes.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }
}

/// `data` as writable bytes.
pub fn f32_bytes_mut(data: &mut [f32]) -> &mut [u8] {
    // SAFETY: f32 has no padding and every byte pattern is a valid f32, so the bytes may be
    // read and written; the length is the slice's size in bytes.
    unsafe {
        std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(data))
    }
}

/// A zeroed f32 vector, backed by huge pages where the kernel allows (large zeroed allocations
/// come untouched from the system, so the advice applies before the first fault).
pub fn zeroed_f32(n: usize) -> Vec<f32> {
    let mut v = vec![0.0f32; n];
    advise_huge(f32_bytes_mut(&mut v));
    v
}

/// A copy of `src` in a fresh buffer backed by huge pages where the kernel allows.
pub fn huge_copy(src: &[f32]) -> Vec<f32> {
    let mut v = zeroed_f32(src.len());
    v.copy_from_slice(src);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_hold_what_was_asked() {
        let v = zeroed_f32(3 << 20);
        assert!(v.iter().all(|&x| x == 0.0));
        let src: Vec<f32> = (0..(2 << 20)).map(|i| i as f32).collect();
        assert_eq!(huge_copy(&src), src);
        assert!(zeroed_f32(0).is_empty());
    }
}
