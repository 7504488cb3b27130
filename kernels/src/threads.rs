//! The kernels' thread count: one global rayon pool, sized once per process.

/// Sizes the global rayon pool used by every kernel. `0` means all cores. Only the first call
/// in a process takes effect (rayon's global pool cannot be resized); later calls return the
/// size in force.
pub fn init(threads: usize) -> usize {
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
    rayon::current_num_threads()
}

/// Threads the kernels use.
pub fn current() -> usize {
    rayon::current_num_threads()
}

/// Runs `f` on one of the pool's threads (the caller waits): the kernels `f` calls then split
/// their work from inside the pool, where a call from outside would hand every kernel to the
/// pool and wait for it (a wake-up of the pool and of the caller per kernel, and the pool's
/// idle threads spinning beside a caller doing serial work). A step of a small model makes
/// hundreds of kernel calls.
pub fn inside<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}
