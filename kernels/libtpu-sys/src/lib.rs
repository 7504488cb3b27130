//! Raw FFI to the PJRT C API (`pjrt_c_api.h`), loaded at run time from a plugin shared library
//! (`libtpu.so`, the CUDA plugin, or the XLA CPU plugin).
//!
//! Owns: `#[repr(C)]` declarations and the loader. Never: links a plugin at build time, or
//! needs libclang or protoc to build.
//!
//! Two layers: the raw table ([`PjrtApi`], the `*_Args` structs, [`probe`], which reads a
//! plugin's API version without initialising it, as `trellis doctor` reports) and, in [`pjrt`],
//! a safe wrapper (plugin, client, compile, buffers, execute, events) whose errors carry the
//! plugin's own message. The declarations follow `pjrt_c_api.h` of API 0.81 (the header inside
//! the `xla-cpu-pjrt` wheel); newer plugins (libtpu: 0.117) only append to every struct, and
//! each call passes the `struct_size` it was written for, as the C API's versioning requires.

pub mod locate;
pub mod pjrt;
// Always compiled (a few functions, no dependencies): behind a feature that only the test
// builds turned on, `cargo build -p trellis` — which the end-to-end tests run to get the binary —
// resolved libtpu-sys differently from `cargo test --workspace` and rebuilt every crate above it.
pub mod testing;

use std::ffi::{c_char, c_int, c_void};
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

/// An opaque `PJRT_Error`.
#[repr(C)]
pub struct PjrtErrorRaw {
    _private: [u8; 0],
}

/// An entry of the table: every PJRT call takes one `*_Args` struct and returns an error or null.
pub type Call = Option<unsafe extern "C" fn(*mut c_void) -> *mut PjrtErrorRaw>;
/// The two entries that return nothing (`PJRT_Error_Destroy`, `PJRT_Error_Message`).
pub type VoidCall = Option<unsafe extern "C" fn(*mut c_void)>;

/// `PJRT_Api` up to the entries Trellis calls, in the header's order (PJRT only appends to the
/// table, so this prefix is the same in every plugin since API 0.40). Check
/// [`PjrtApi::has`] before calling an entry: an older plugin's table may end earlier.
#[repr(C)]
#[derive(Debug)]
pub struct PjrtApi {
    pub head: PjrtApiHead,
    pub error_destroy: VoidCall,
    pub error_message: VoidCall,
    pub error_get_code: Call,
    pub plugin_initialize: Call,
    pub plugin_attributes: Call,
    pub event_destroy: Call,
    pub event_is_ready: Call,
    pub event_error: Call,
    pub event_await: Call,
    pub event_on_ready: Call,
    pub client_create: Call,
    pub client_destroy: Call,
    pub client_platform_name: Call,
    pub client_process_index: Call,
    pub client_platform_version: Call,
    pub client_devices: Call,
    pub client_addressable_devices: Call,
    pub client_lookup_device: Call,
    pub client_lookup_addressable_device: Call,
    pub client_addressable_memories: Call,
    pub client_compile: Call,
    pub client_default_device_assignment: Call,
    pub client_buffer_from_host_buffer: Call,
    pub device_description_id: Call,
    pub device_description_process_index: Call,
    pub device_description_attributes: Call,
    pub device_description_kind: Call,
    pub device_description_debug_string: Call,
    pub device_description_to_string: Call,
    pub device_get_description: Call,
    pub device_is_addressable: Call,
    pub device_local_hardware_id: Call,
    pub device_addressable_memories: Call,
    pub device_default_memory: Call,
    pub device_memory_stats: Call,
    pub memory_id: Call,
    pub memory_kind: Call,
    pub memory_debug_string: Call,
    pub memory_to_string: Call,
    pub memory_addressable_by_devices: Call,
    pub executable_destroy: Call,
    pub executable_name: Call,
    pub executable_num_replicas: Call,
    pub executable_num_partitions: Call,
    pub executable_num_outputs: Call,
    pub executable_size_of_generated_code_in_bytes: Call,
    pub executable_get_cost_analysis: Call,
    pub executable_output_memory_kinds: Call,
    pub executable_optimized_program: Call,
    pub executable_serialize: Call,
    pub loaded_executable_destroy: Call,
    pub loaded_executable_get_executable: Call,
    pub loaded_executable_addressable_devices: Call,
    pub loaded_executable_delete: Call,
    pub loaded_executable_is_deleted: Call,
    pub loaded_executable_execute: Call,
    pub executable_deserialize_and_load: Call,
    pub loaded_executable_fingerprint: Call,
    pub buffer_destroy: Call,
    pub buffer_element_type: Call,
    pub buffer_dimensions: Call,
    pub buffer_unpadded_dimensions: Call,
    pub buffer_dynamic_dimension_indices: Call,
    pub buffer_get_memory_layout: Call,
    pub buffer_on_device_size_in_bytes: Call,
    pub buffer_device: Call,
    pub buffer_memory: Call,
    pub buffer_delete: Call,
    pub buffer_is_deleted: Call,
    pub buffer_copy_to_device: Call,
    pub buffer_to_host_buffer: Call,
}

impl PjrtApi {
    /// Whether the plugin's table reaches the entry at byte `offset` (from `offset_of!`).
    pub fn has(&self, offset: usize) -> bool {
        self.head.struct_size >= offset + std::mem::size_of::<Call>()
    }
}

/// `PJRT_Buffer_Type` values Trellis uses.
pub mod buffer_type {
    pub const S32: i32 = 4;
    pub const F32: i32 = 11;
    pub const BF16: i32 = 13;
}

/// `PJRT_HostBufferSemantics_kImmutableOnlyDuringCall`: the plugin copies during the call.
pub const IMMUTABLE_ONLY_DURING_CALL: i32 = 0;

/// `PJRT_NamedValue_kInt64`.
pub const NAMED_INT64: i32 = 1;

/// Declares a `PJRT_*_Args` struct: `struct_size` and `extension_start` first, then the fields;
/// `new()` zeroes it and sets `struct_size`.
macro_rules! args {
    ($(#[$m:meta])* $name:ident { $($f:ident : $t:ty),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        pub struct $name {
            pub struct_size: usize,
            pub extension_start: *mut c_void,
            $(pub $f: $t),*
        }
        impl $name {
            /// Zeroed, with `struct_size` set.
            pub fn new() -> Self {
                // SAFETY: every field is a pointer, integer or `Option` of a function pointer,
                // for which all-zero bytes are a valid value (null / 0 / None).
                let mut a: Self = unsafe { std::mem::zeroed() };
                a.struct_size = std::mem::size_of::<Self>();
                a
            }
        }
        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }
    };
}

args!(ErrorDestroyArgs { error: *mut PjrtErrorRaw });
args!(ErrorMessageArgs { error: *const PjrtErrorRaw, message: *const c_char, message_size: usize });
args!(ErrorGetCodeArgs { error: *const PjrtErrorRaw, code: c_int });
args!(PluginInitializeArgs {});
args!(EventDestroyArgs { event: *mut c_void });
args!(EventAwaitArgs { event: *mut c_void });
args!(ClientCreateArgs {
    create_options: *const c_void,
    num_options: usize,
    kv_get_callback: *mut c_void,
    kv_get_user_arg: *mut c_void,
    kv_put_callback: *mut c_void,
    kv_put_user_arg: *mut c_void,
    client: *mut c_void,
    kv_try_get_callback: *mut c_void,
    kv_try_get_user_arg: *mut c_void,
});
args!(ClientDestroyArgs { client: *mut c_void });
args!(ClientPlatformNameArgs { client: *mut c_void, platform_name: *const c_char, platform_name_size: usize });
args!(ClientAddressableDevicesArgs {
    client: *mut c_void,
    addressable_devices: *const *mut c_void,
    num_addressable_devices: usize,
});
args!(Program { code: *const c_char, code_size: usize, format: *const c_char, format_size: usize });
args!(ClientCompileArgs {
    client: *mut c_void,
    program: *const Program,
    compile_options: *const c_char,
    compile_options_size: usize,
    executable: *mut c_void,
});
args!(ClientBufferFromHostBufferArgs {
    client: *mut c_void,
    data: *const c_void,
    type_: c_int,
    dims: *const i64,
    num_dims: usize,
    byte_strides: *const i64,
    num_byte_strides: usize,
    host_buffer_semantics: c_int,
    device: *mut c_void,
    memory: *mut c_void,
    device_layout: *mut c_void,
    done_with_host_buffer: *mut c_void,
    buffer: *mut c_void,
});
args!(ExecuteOptions {
    send_callbacks: *mut c_void,
    recv_callbacks: *mut c_void,
    num_send_ops: usize,
    num_recv_ops: usize,
    launch_id: c_int,
    non_donatable_input_indices: *const i64,
    num_non_donatable_input_indices: usize,
    context: *mut c_void,
    call_location: *const c_char,
    num_tasks: usize,
    task_ids: *mut c_int,
    incarnation_ids: *mut i64,
});
args!(LoadedExecutableExecuteArgs {
    executable: *mut c_void,
    options: *mut ExecuteOptions,
    argument_lists: *const *const *mut c_void,
    num_devices: usize,
    num_args: usize,
    output_lists: *const *mut *mut c_void,
    device_complete_events: *mut *mut c_void,
    execute_device: *mut c_void,
});
args!(LoadedExecutableDestroyArgs { executable: *mut c_void });
args!(LoadedExecutableAddressableDevicesArgs {
    executable: *mut c_void,
    addressable_devices: *const *mut c_void,
    num_addressable_devices: usize,
});
args!(NamedValue { name: *const c_char, name_size: usize, type_: c_int, int64_value: i64, value_size: usize });
args!(LoadedExecutableGetExecutableArgs { loaded_executable: *mut c_void, executable: *mut c_void });
args!(ExecutableNumOutputsArgs { executable: *mut c_void, num_outputs: usize });
args!(ExecutableDestroyArgs { executable: *mut c_void });
args!(BufferDestroyArgs { buffer: *mut c_void });
args!(BufferDimensionsArgs { buffer: *mut c_void, dims: *const i64, num_dims: usize });
args!(BufferElementTypeArgs { buffer: *mut c_void, type_: c_int });
args!(BufferToHostBufferArgs {
    src: *mut c_void,
    host_layout: *mut c_void,
    dst: *mut c_void,
    dst_size: usize,
    event: *mut c_void,
});

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

    /// The XLA CPU plugin's version is read without initialising it.
    #[test]
    fn the_cpu_plugin_reports_its_api_version() {
        let Some(path) = crate::testing::cpu_plugin() else {
            return;
        };
        let info = probe(Path::new(&path)).unwrap();
        assert_eq!(info.major, 0);
        assert!(info.minor >= 50, "{info:?}");
        assert!(info.api_struct_size > 200, "{info:?}");
    }
}
