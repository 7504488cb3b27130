//! Raw FFI to the PJRT C API (`pjrt_c_api.h`), loaded at run time from a plugin shared library
//! (`libtpu.so`, the CUDA plugin, or the XLA CPU plugin).
//!
//! Owns: `#[repr(C)]` declarations and the loader. Never: links a plugin at build time, or
//! needs libclang or protoc to build.
//!
//! Today: the head of `PJRT_Api` and [`probe`], which opens a plugin and reads the API version
//! it implements without initialising it (what `trellis doctor` reports). The rest of the table
//! comes with the PJRT engines.

use std::ffi::{c_int, c_void};
use std::path::{Path, PathBuf};

/// `PJRT_Api_Version`: the API version a plugin implements.
#[repr(C)]
#[derive(Debug)]
pub struct PjrtApiVersion {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub major_version: c_int,
    pub minor_version: c_int,
}

/// The first fields of `PJRT_Api`, the same in every version of the header.
#[repr(C)]
#[derive(Debug)]
pub struct PjrtApiHead {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub pjrt_api_version: PjrtApiVersion,
}

/// `GetPjrtApi`, the one symbol a plugin exports.
pub type GetPjrtApi = unsafe extern "C" fn() -> *const PjrtApiHead;

/// What [`probe`] found in a plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginInfo {
    /// The file.
    pub path: PathBuf,
    /// `PJRT_API_MAJOR` it was built with.
    pub major: i32,
    /// `PJRT_API_MINOR` it was built with.
    pub minor: i32,
    /// `sizeof(PJRT_Api)` in the plugin: which entries of the table exist.
    pub api_struct_size: usize,
}

/// Why a plugin cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("{path}: cannot load it: {message}")]
    Load { path: PathBuf, message: String },
    #[error("{path}: not a PJRT plugin (it exports no GetPjrtApi)")]
    NotPjrt { path: PathBuf },
    #[error("{path}: GetPjrtApi returned {what}")]
    BadTable { path: PathBuf, what: String },
}

/// Opens the plugin at `path`, calls `GetPjrtApi` and reads the version it reports. Does not
/// initialise the plugin (no devices are claimed). The library stays loaded for the life of the
/// process, as plugins expect.
pub fn probe(path: &Path) -> Result<PluginInfo, PluginError> {
    let p = || path.to_path_buf();
    // SAFETY: loading a shared library runs its initialisers; PJRT plugins are built to be
    // dlopen-ed by frameworks this way.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| PluginError::Load {
        path: p(),
        message: e.to_string(),
    })?;
    // SAFETY: the symbol's type is the one the PJRT header declares.
    let get: libloading::Symbol<'_, GetPjrtApi> =
        unsafe { lib.get(b"GetPjrtApi\0") }.map_err(|_| PluginError::NotPjrt { path: p() })?;
    // SAFETY: GetPjrtApi takes no arguments and returns a pointer to a static table.
    let api = unsafe { get() };
    if api.is_null() {
        return Err(PluginError::BadTable {
            path: p(),
            what: "a null table".into(),
        });
    }
    // SAFETY: non-null, and every PJRT_Api starts with these fields.
    let head = unsafe { &*api };
    if head.struct_size < std::mem::size_of::<PjrtApiHead>() {
        return Err(PluginError::BadTable {
            path: p(),
            what: format!("a table of {} bytes", head.struct_size),
        });
    }
    let info = PluginInfo {
        path: p(),
        major: head.pjrt_api_version.major_version,
        minor: head.pjrt_api_version.minor_version,
        api_struct_size: head.struct_size,
    };
    // Plugins are not built to be unloaded.
    std::mem::forget(lib);
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_without_get_pjrt_api_is_named_and_refused() {
        let e = probe(Path::new("libc.so.6")).unwrap_err();
        assert!(matches!(e, PluginError::NotPjrt { .. }), "{e}");
        assert!(e.to_string().contains("not a PJRT plugin"), "{e}");
        let e = probe(Path::new("/nonexistent/libtpu.so")).unwrap_err();
        assert!(matches!(e, PluginError::Load { .. }), "{e}");
        assert!(e.to_string().contains("/nonexistent/libtpu.so"), "{e}");
    }

    /// With `TRELLIS_PJRT_CPU_PLUGIN` pointing at the XLA CPU plugin (`xla_cpu_pjrt.so` from the
    /// `xla-cpu-pjrt` wheel), its version is read. Skipped loudly without it.
    #[test]
    fn the_cpu_plugin_reports_its_api_version() {
        let Some(path) = std::env::var_os("TRELLIS_PJRT_CPU_PLUGIN") else {
            eprintln!(
                "*** SKIPPED: set TRELLIS_PJRT_CPU_PLUGIN to the XLA CPU plugin to probe it ***"
            );
            return;
        };
        let info = probe(Path::new(&path)).unwrap();
        assert_eq!(info.major, 0);
        assert!(info.minor >= 50, "{info:?}");
        assert!(info.api_struct_size > 200, "{info:?}");
    }
}
