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
