//! Raw FFI to the PJRT C API (`pjrt_c_api.h`), loaded at run time from a plugin shared library
//! (`libtpu.so`, the CUDA plugin, or the XLA CPU plugin).
//!
//! Owns: `#[repr(C)]` declarations and the loader. Never: links a plugin at build time, or
//! needs libclang or protoc to build.
