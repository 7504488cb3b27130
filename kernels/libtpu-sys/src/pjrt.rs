//! A safe wrapper over the PJRT C API: load and initialise a plugin once per process, create a
//! client, compile StableHLO text, move f32/i32 buffers to and from the device, execute, and
//! await events. Every failure is a [`PjrtError`] carrying the plugin's own message.
//!
//! Owns: the lifetimes of PJRT objects (each wrapper destroys what it created). Never: builds
//! programs (the learner emits StableHLO) or knows what a model is.

use crate::*;
use std::collections::HashMap;
use std::mem::offset_of;
use std::sync::{Arc, Mutex, OnceLock};

/// Why a PJRT call failed.
#[derive(Debug, thiserror::Error)]
pub enum PjrtError {
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error("{call} failed (code {code}): {message}")]
    Call {
        call: &'static str,
        code: i32,
        message: String,
    },
    #[error("the plugin implements PJRT API {major}.{minor}, which has no {call}")]
    Missing {
        call: &'static str,
        major: i32,
        minor: i32,
    },
    #[error("{0}")]
    Usage(String),
}

/// A loaded, initialised plugin. Plugins are never unloaded.
#[derive(Debug)]
pub struct Plugin {
    api: &'static PjrtApi,
    /// Where it was loaded from.
    pub info: PluginInfo,
}

fn registry() -> &'static Mutex<HashMap<PathBuf, Arc<Plugin>>> {
    static R: OnceLock<Mutex<HashMap<PathBuf, Arc<Plugin>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

impl Plugin {
    /// Loads the plugin at `path` and calls `PJRT_Plugin_Initialize`, once per process and path.
    pub fn load(path: &Path) -> Result<Arc<Plugin>, PjrtError> {
        let mut reg = registry()
            .lock()
            .map_err(|_| PjrtError::Usage("the plugin registry is poisoned".into()))?;
        if let Some(p) = reg.get(path) {
            return Ok(p.clone());
        }
        let info = probe(path)?;
        // SAFETY: `probe` checked the symbol exists and returns a non-null table at least as
        // large as its head; the library stays loaded for the life of the process.
        let api: &'static PjrtApi = unsafe {
            let lib = libloading::Library::new(path).map_err(|e| PluginError::Load {
                path: path.into(),
                message: e.to_string(),
            })?;
            let get: libloading::Symbol<'_, GetPjrtApi> = lib
                .get(b"GetPjrtApi\0")
                .map_err(|_| PluginError::NotPjrt { path: path.into() })?;
            let api = get() as *const PjrtApi;
            std::mem::forget(lib);
            &*api
        };
        let plugin = Arc::new(Plugin { api, info });
        let mut args = PluginInitializeArgs::new();
        plugin.call(
            offset_of!(PjrtApi, plugin_initialize),
            api.plugin_initialize,
            "PJRT_Plugin_Initialize",
            &mut args,
        )?;
        reg.insert(path.to_path_buf(), plugin.clone());
        Ok(plugin)
    }

    /// Calls a table entry with its args struct, turning a returned `PJRT_Error` into
    /// [`PjrtError::Call`].
    fn call<A>(
        &self,
        offset: usize,
        f: Call,
        name: &'static str,
        args: &mut A,
    ) -> Result<(), PjrtError> {
        let f = match f {
            Some(f) if self.api.has(offset) => f,
            _ => {
                return Err(PjrtError::Missing {
                    call: name,
                    major: self.info.major,
                    minor: self.info.minor,
                });
            }
        };
        // SAFETY: `args` is the `*_Args` struct of entry `name`, laid out as the header says,
        // with `struct_size` set by its constructor.
        let err = unsafe { f(args as *mut A as *mut c_void) };
        if err.is_null() {
            Ok(())
        } else {
            Err(self.take_error(err, name))
        }
    }

    fn take_error(&self, err: *mut PjrtErrorRaw, call: &'static str) -> PjrtError {
        let mut msg = ErrorMessageArgs::new();
        msg.error = err;
        let message = match self.api.error_message {
            // SAFETY: `err` is a live error returned by the plugin.
            Some(f) => unsafe {
                f(&mut msg as *mut _ as *mut c_void);
                if msg.message.is_null() {
                    String::new()
                } else {
                    let bytes =
                        std::slice::from_raw_parts(msg.message as *const u8, msg.message_size);
                    String::from_utf8_lossy(bytes).into_owned()
                }
            },
            None => String::new(),
        };
        let mut code = ErrorGetCodeArgs::new();
        code.error = err;
        if let Some(f) = self.api.error_get_code {
            // SAFETY: as above; a failure here leaves `code` at 0.
            unsafe { f(&mut code as *mut _ as *mut c_void) };
        }
        if let Some(f) = self.api.error_destroy {
            let mut d = ErrorDestroyArgs::new();
            d.error = err;
            // SAFETY: destroys the error exactly once.
            unsafe { f(&mut d as *mut _ as *mut c_void) };
        }
        PjrtError::Call {
            call,
            code: code.code,
            message,
        }
    }

    fn await_event(&self, event: *mut c_void, call: &'static str) -> Result<(), PjrtError> {
        if event.is_null() {
            return Ok(());
        }
        let mut a = EventAwaitArgs::new();
        a.event = event;
        let r = self.call(
            offset_of!(PjrtApi, event_await),
            self.api.event_await,
            call,
            &mut a,
        );
        let mut d = EventDestroyArgs::new();
        d.event = event;
        let _ = self.call(
            offset_of!(PjrtApi, event_destroy),
            self.api.event_destroy,
            "PJRT_Event_Destroy",
            &mut d,
        );
        r
    }
}

struct ClientInner {
    plugin: Arc<Plugin>,
    raw: *mut c_void,
    /// The addressable devices this client uses, in the plugin's order.
    devices: Vec<*mut c_void>,
    /// Which PJRT client of this process it is (1, 2, … in creation order).
    serial: usize,
}

// SAFETY: PJRT clients, buffers and executables are thread-safe by the C API's contract.
unsafe impl Send for ClientInner {}
// SAFETY: the table is immutable and its entries thread-safe by the C API's contract.
unsafe impl Send for Plugin {}
// SAFETY: as above.
unsafe impl Sync for Plugin {}
// SAFETY: as above.
unsafe impl Sync for ClientInner {}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let mut a = ClientDestroyArgs::new();
        a.client = self.raw;
        let _ = self.plugin.call(
            offset_of!(PjrtApi, client_destroy),
            self.plugin.api.client_destroy,
            "PJRT_Client_Destroy",
            &mut a,
        );
    }
}

/// A PJRT client on one plugin, using its first addressable device, or its first N for
/// replicated programs ([`Client::with_devices`], [`Client::compile_replicated`]). A process
/// holds one PJRT client per plugin while any handle lives (a learner and a rollout engine in
/// one process share it, as one process owns a TPU host's chips); handles differ only in how
/// many of its devices they use.
#[derive(Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
    /// The first this many of `inner`'s devices are this handle's.
    used: usize,
    platform: String,
}

/// The live PJRT client of each plugin (by path), and its platform.
type Clients = HashMap<PathBuf, (std::sync::Weak<ClientInner>, String)>;

fn clients() -> &'static Mutex<Clients> {
    static C: OnceLock<Mutex<Clients>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// An f32 or i32 array on the device.
pub struct Buffer {
    client: Arc<ClientInner>,
    raw: *mut c_void,
}

// SAFETY: see `ClientInner`.
unsafe impl Send for Buffer {}
// SAFETY: see `ClientInner`.
unsafe impl Sync for Buffer {}

/// A compiled program, loaded on the client's device (or devices: one replica each).
pub struct Executable {
    client: Arc<ClientInner>,
    raw: *mut c_void,
    num_outputs: usize,
    /// The client device (index into its devices) that runs each replica, in replica order.
    devices: Vec<usize>,
}

// SAFETY: see `ClientInner`.
unsafe impl Send for Executable {}
// SAFETY: see `ClientInner`.
unsafe impl Sync for Executable {}

/// `xla.CompileOptionsProto{executable_build_options: {num_replicas: N, num_partitions: 1}}`:
/// the smallest options the plugins accept (empty options abort the CPU plugin), with the
/// default device assignment (replica `i` on the plugin's `i`-th device of its choice).
fn compile_options(replicas: usize) -> Vec<u8> {
    let mut build = vec![0x20];
    let mut n = replicas as u64;
    loop {
        let b = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            build.push(b);
            break;
        }
        build.push(b | 0x80);
    }
    build.extend([0x28, 0x01]);
    let mut out = vec![0x1a, build.len() as u8];
    out.extend(build);
    out
}

impl Client {
    /// Creates a client on `plugin` (loaded and initialised by [`Plugin::load`]).
    pub fn new(plugin: Arc<Plugin>) -> Result<Self, PjrtError> {
        Self::with_devices(plugin, 1)
    }

    /// A client that uses the first `devices` addressable devices of `plugin`, for programs
    /// replicated over them: the plugin's live client when it has that many, else a new one.
    /// The XLA CPU plugin is asked for that many host devices (`cpu_device_count`); other
    /// plugins must see them (a TPU host's chips, a node's GPUs).
    pub fn with_devices(plugin: Arc<Plugin>, devices: usize) -> Result<Self, PjrtError> {
        if devices == 0 {
            return Err(PjrtError::Usage(
                "a client needs at least one device".into(),
            ));
        }
        let mut live = clients()
            .lock()
            .map_err(|_| PjrtError::Usage("the client registry is poisoned".into()))?;
        let key = plugin.info.path.clone();
        if let Some((weak, platform)) = live.get(&key)
            && let Some(inner) = weak.upgrade()
            && inner.devices.len() >= devices
        {
            return Ok(Client {
                inner,
                used: devices,
                platform: platform.clone(),
            });
        }
        let mut c = Self::create(plugin.clone(), None)?;
        if c.inner.devices.len() < devices && c.platform() == "cpu" {
            drop(c);
            c = Self::create(plugin.clone(), Some(devices))?;
        }
        if c.inner.devices.len() >= devices {
            live.insert(key, (Arc::downgrade(&c.inner), c.platform.clone()));
            c.used = devices;
            return Ok(c);
        }
        Err(PjrtError::Usage(format!(
            "{} devices wanted, but the plugin {} sees {} ({})",
            devices,
            plugin.info.path.display(),
            c.inner.devices.len(),
            c.platform()
        )))
    }

    /// A client of every addressable device; `cpu_devices`: asks the CPU plugin for that many.
    fn create(plugin: Arc<Plugin>, cpu_devices: Option<usize>) -> Result<Self, PjrtError> {
        let api = plugin.api;
        let mut c = ClientCreateArgs::new();
        let name = "cpu_device_count";
        let mut option = NamedValue::new();
        if let Some(n) = cpu_devices {
            option.name = name.as_ptr() as *const c_char;
            option.name_size = name.len();
            option.type_ = NAMED_INT64;
            option.int64_value = n as i64;
            option.value_size = 1;
            c.create_options = &option as *const NamedValue as *const c_void;
            c.num_options = 1;
        }
        plugin.call(
            offset_of!(PjrtApi, client_create),
            api.client_create,
            "PJRT_Client_Create",
            &mut c,
        )?;
        let mut d = ClientAddressableDevicesArgs::new();
        d.client = c.client;
        let mut name = ClientPlatformNameArgs::new();
        name.client = c.client;
        static SERIAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
        let mut inner = ClientInner {
            plugin: plugin.clone(),
            raw: c.client,
            devices: Vec::new(),
            serial: SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        };
        plugin.call(
            offset_of!(PjrtApi, client_addressable_devices),
            api.client_addressable_devices,
            "PJRT_Client_AddressableDevices",
            &mut d,
        )?;
        if d.num_addressable_devices == 0 || d.addressable_devices.is_null() {
            return Err(PjrtError::Usage(format!(
                "{}: the plugin sees no addressable device",
                plugin.info.path.display()
            )));
        }
        plugin.call(
            offset_of!(PjrtApi, client_platform_name),
            api.client_platform_name,
            "PJRT_Client_PlatformName",
            &mut name,
        )?;
        // SAFETY: the plugin returned `num_addressable_devices` (> 0) device pointers, and a
        // platform name of `platform_name_size` bytes, both owned by the client.
        let platform = unsafe {
            inner.devices =
                std::slice::from_raw_parts(d.addressable_devices, d.num_addressable_devices)
                    .to_vec();
            String::from_utf8_lossy(std::slice::from_raw_parts(
                name.platform_name as *const u8,
                name.platform_name_size,
            ))
            .into_owned()
        };
        Ok(Client {
            used: inner.devices.len(),
            inner: Arc::new(inner),
            platform,
        })
    }

    /// A handle of the same plugin's client using its first `devices` devices.
    pub fn with_device_count(&self, devices: usize) -> Result<Self, PjrtError> {
        Self::with_devices(self.inner.plugin.clone(), devices)
    }

    /// Loads the plugin at `path` and creates a client on it.
    pub fn open(path: &Path) -> Result<Self, PjrtError> {
        Self::new(Plugin::load(path)?)
    }

    /// The platform the plugin reports (`cpu`, `tpu`, `cuda`).
    pub fn platform(&self) -> &str {
        &self.platform
    }

    fn plugin(&self) -> &Plugin {
        &self.inner.plugin
    }

    /// How many devices the client uses.
    pub fn device_count(&self) -> usize {
        self.used
    }

    /// Whether `other` is a handle of the same PJRT client.
    pub fn shares_with(&self, other: &Client) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Which PJRT client of this process the handle uses (1, 2, … in creation order): equal
    /// for handles that share one.
    pub fn serial(&self) -> usize {
        self.inner.serial
    }

    /// Compiles a StableHLO module given as MLIR text, for the client's first device.
    pub fn compile(&self, mlir: &str) -> Result<Executable, PjrtError> {
        self.compile_replicated(mlir, 1)
    }

    /// Compiles a StableHLO module to run as `replicas` copies, one on each of the client's
    /// first devices (its collectives, e.g. `stablehlo.all_reduce`, span the replicas).
    pub fn compile_replicated(&self, mlir: &str, replicas: usize) -> Result<Executable, PjrtError> {
        if replicas == 0 || replicas > self.device_count() {
            return Err(PjrtError::Usage(format!(
                "{replicas} replicas on a client of {} devices",
                self.device_count()
            )));
        }
        let options = compile_options(replicas);
        let p = self.plugin();
        let format = "mlir";
        let mut prog = Program::new();
        prog.code = mlir.as_ptr() as *const c_char;
        prog.code_size = mlir.len();
        prog.format = format.as_ptr() as *const c_char;
        prog.format_size = format.len();
        let mut a = ClientCompileArgs::new();
        a.client = self.inner.raw;
        a.program = &prog;
        a.compile_options = options.as_ptr() as *const c_char;
        a.compile_options_size = options.len();
        p.call(
            offset_of!(PjrtApi, client_compile),
            p.api.client_compile,
            "PJRT_Client_Compile",
            &mut a,
        )?;
        let loaded = a.executable;
        let mut g = LoadedExecutableGetExecutableArgs::new();
        g.loaded_executable = loaded;
        let mut exe = Executable {
            client: self.inner.clone(),
            raw: loaded,
            num_outputs: 0,
            devices: Vec::new(),
        };
        p.call(
            offset_of!(PjrtApi, loaded_executable_get_executable),
            p.api.loaded_executable_get_executable,
            "PJRT_LoadedExecutable_GetExecutable",
            &mut g,
        )?;
        let mut n = ExecutableNumOutputsArgs::new();
        n.executable = g.executable;
        let r = p.call(
            offset_of!(PjrtApi, executable_num_outputs),
            p.api.executable_num_outputs,
            "PJRT_Executable_NumOutputs",
            &mut n,
        );
        let mut d = ExecutableDestroyArgs::new();
        d.executable = g.executable;
        let _ = p.call(
            offset_of!(PjrtApi, executable_destroy),
            p.api.executable_destroy,
            "PJRT_Executable_Destroy",
            &mut d,
        );
        r?;
        exe.num_outputs = n.num_outputs;
        let mut ad = LoadedExecutableAddressableDevicesArgs::new();
        ad.executable = loaded;
        p.call(
            offset_of!(PjrtApi, loaded_executable_addressable_devices),
            p.api.loaded_executable_addressable_devices,
            "PJRT_LoadedExecutable_AddressableDevices",
            &mut ad,
        )?;
        let raw: &[*mut c_void] = if ad.addressable_devices.is_null() {
            &[]
        } else {
            // SAFETY: the plugin returned `num_addressable_devices` pointers owned by the
            // executable, which outlives this borrow.
            unsafe {
                std::slice::from_raw_parts(ad.addressable_devices, ad.num_addressable_devices)
            }
        };
        exe.devices = raw
            .iter()
            .map(|d| self.inner.devices[..self.used].iter().position(|x| x == d))
            .collect::<Option<Vec<usize>>>()
            .filter(|v| v.len() == replicas)
            .ok_or_else(|| {
                PjrtError::Usage(format!(
                    "the plugin placed {replicas} replicas on {} devices, not on the client's first {replicas}",
                    raw.len()
                ))
            })?;
        Ok(exe)
    }

    fn buffer(
        &self,
        device: usize,
        data: *const c_void,
        ty: c_int,
        dims: &[usize],
    ) -> Result<Buffer, PjrtError> {
        let p = self.plugin();
        let device = *self.inner.devices[..self.used].get(device).ok_or_else(|| {
            PjrtError::Usage(format!(
                "device {device} of a client of {}",
                self.device_count()
            ))
        })?;
        let dims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let mut a = ClientBufferFromHostBufferArgs::new();
        a.client = self.inner.raw;
        a.data = data;
        a.type_ = ty;
        a.dims = dims.as_ptr();
        a.num_dims = dims.len();
        a.host_buffer_semantics = IMMUTABLE_ONLY_DURING_CALL;
        a.device = device;
        p.call(
            offset_of!(PjrtApi, client_buffer_from_host_buffer),
            p.api.client_buffer_from_host_buffer,
            "PJRT_Client_BufferFromHostBuffer",
            &mut a,
        )?;
        let b = Buffer {
            client: self.inner.clone(),
            raw: a.buffer,
        };
        p.await_event(a.done_with_host_buffer, "PJRT_Event_Await (host buffer)")?;
        Ok(b)
    }

    fn check(len: usize, dims: &[usize]) -> Result<(), PjrtError> {
        let n: usize = dims.iter().product();
        if n != len {
            return Err(PjrtError::Usage(format!(
                "{len} values do not fill shape {dims:?} ({n} elements)"
            )));
        }
        Ok(())
    }

    /// Copies `data` (row-major, shape `dims`) to a new f32 buffer on the first device.
    pub fn f32(&self, data: &[f32], dims: &[usize]) -> Result<Buffer, PjrtError> {
        self.f32_on(0, data, dims)
    }

    /// Copies `data` (row-major, shape `dims`) to a new i32 buffer on the first device.
    pub fn i32(&self, data: &[i32], dims: &[usize]) -> Result<Buffer, PjrtError> {
        self.i32_on(0, data, dims)
    }

    /// Copies `data` (row-major, shape `dims`) to a new f32 buffer on the client's `device`.
    pub fn f32_on(&self, device: usize, data: &[f32], dims: &[usize]) -> Result<Buffer, PjrtError> {
        Self::check(data.len(), dims)?;
        self.buffer(
            device,
            data.as_ptr() as *const c_void,
            buffer_type::F32,
            dims,
        )
    }

    /// Copies `data` (row-major, shape `dims`) to a new i32 buffer on the client's `device`.
    pub fn i32_on(&self, device: usize, data: &[i32], dims: &[usize]) -> Result<Buffer, PjrtError> {
        Self::check(data.len(), dims)?;
        self.buffer(
            device,
            data.as_ptr() as *const c_void,
            buffer_type::S32,
            dims,
        )
    }
}

impl Buffer {
    fn plugin(&self) -> &Plugin {
        &self.client.plugin
    }

    /// The buffer's dimensions.
    pub fn dims(&self) -> Result<Vec<usize>, PjrtError> {
        let p = self.plugin();
        let mut a = BufferDimensionsArgs::new();
        a.buffer = self.raw;
        p.call(
            offset_of!(PjrtApi, buffer_dimensions),
            p.api.buffer_dimensions,
            "PJRT_Buffer_Dimensions",
            &mut a,
        )?;
        if a.num_dims == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: the plugin returned `num_dims` dimensions owned by the buffer.
        let d = unsafe { std::slice::from_raw_parts(a.dims, a.num_dims) };
        Ok(d.iter().map(|&x| x as usize).collect())
    }

    fn element_type(&self) -> Result<c_int, PjrtError> {
        let p = self.plugin();
        let mut a = BufferElementTypeArgs::new();
        a.buffer = self.raw;
        p.call(
            offset_of!(PjrtApi, buffer_element_type),
            p.api.buffer_element_type,
            "PJRT_Buffer_ElementType",
            &mut a,
        )?;
        Ok(a.type_)
    }

    fn read_into(&self, dst: *mut c_void, bytes: usize) -> Result<(), PjrtError> {
        let p = self.plugin();
        let mut a = BufferToHostBufferArgs::new();
        a.src = self.raw;
        a.dst = dst;
        a.dst_size = bytes;
        p.call(
            offset_of!(PjrtApi, buffer_to_host_buffer),
            p.api.buffer_to_host_buffer,
            "PJRT_Buffer_ToHostBuffer",
            &mut a,
        )?;
        p.await_event(a.event, "PJRT_Event_Await (to host)")
    }

    /// Copies an f32 buffer to the host.
    pub fn to_f32(&self) -> Result<Vec<f32>, PjrtError> {
        let ty = self.element_type()?;
        if ty != buffer_type::F32 {
            return Err(PjrtError::Usage(format!(
                "the buffer holds element type {ty}, not f32"
            )));
        }
        let n: usize = self.dims()?.iter().product();
        let mut out = vec![0.0f32; n];
        self.read_into(out.as_mut_ptr() as *mut c_void, n * 4)?;
        Ok(out)
    }

    /// Copies an f32 buffer into `out`, whose length must be the buffer's element count.
    pub fn read_f32(&self, out: &mut [f32]) -> Result<(), PjrtError> {
        let n: usize = self.dims()?.iter().product();
        if n != out.len() {
            return Err(PjrtError::Usage(format!(
                "a buffer of {n} values read into {} slots",
                out.len()
            )));
        }
        self.read_into(out.as_mut_ptr() as *mut c_void, n * 4)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let p = &self.client.plugin;
        let mut a = BufferDestroyArgs::new();
        a.buffer = self.raw;
        let _ = p.call(
            offset_of!(PjrtApi, buffer_destroy),
            p.api.buffer_destroy,
            "PJRT_Buffer_Destroy",
            &mut a,
        );
    }
}

impl Executable {
    /// Number of results the program returns.
    pub fn num_outputs(&self) -> usize {
        self.num_outputs
    }

    /// The client device (an index for [`Client::f32_on`]) that runs each replica, in replica
    /// order: replica `r`'s arguments must live there, and its results come back there.
    pub fn devices(&self) -> &[usize] {
        &self.devices
    }

    /// Runs a single-replica program on `args` and waits for it. Arguments the program marks
    /// as donated (`tf.aliasing_output`) are consumed: their buffers must not be used
    /// afterwards.
    pub fn run(&self, args: &[&Buffer]) -> Result<Vec<Buffer>, PjrtError> {
        let mut outs = self.run_replicated(&[args.to_vec()])?;
        Ok(outs.pop().unwrap_or_default())
    }

    /// Runs every replica at once, replica `r` on `args[r]` (buffers on
    /// [`Executable::devices`]`[r]`), and waits for all; returns each replica's results.
    pub fn run_replicated(&self, args: &[Vec<&Buffer>]) -> Result<Vec<Vec<Buffer>>, PjrtError> {
        let p = &self.client.plugin;
        let n = args.len();
        if n != self.devices.len() || args.iter().any(|a| a.len() != args[0].len()) {
            return Err(PjrtError::Usage(format!(
                "a program of {} replicas run on {n} argument lists of lengths {:?}",
                self.devices.len(),
                args.iter().map(Vec::len).collect::<Vec<_>>()
            )));
        }
        let raw_args: Vec<Vec<*mut c_void>> = args
            .iter()
            .map(|l| l.iter().map(|b| b.raw).collect())
            .collect();
        let lists: Vec<*const *mut c_void> = raw_args.iter().map(|l| l.as_ptr()).collect();
        let mut outs: Vec<Vec<*mut c_void>> = vec![vec![std::ptr::null_mut(); self.num_outputs]; n];
        let out_lists: Vec<*mut *mut c_void> = outs.iter_mut().map(|o| o.as_mut_ptr()).collect();
        let mut events: Vec<*mut c_void> = vec![std::ptr::null_mut(); n];
        let mut opts = ExecuteOptions::new();
        let mut a = LoadedExecutableExecuteArgs::new();
        a.executable = self.raw;
        a.options = &mut opts;
        a.argument_lists = lists.as_ptr();
        a.num_devices = n;
        a.num_args = args[0].len();
        a.output_lists = out_lists.as_ptr();
        a.device_complete_events = events.as_mut_ptr();
        p.call(
            offset_of!(PjrtApi, loaded_executable_execute),
            p.api.loaded_executable_execute,
            "PJRT_LoadedExecutable_Execute",
            &mut a,
        )?;
        let outs: Vec<Vec<Buffer>> = outs
            .into_iter()
            .map(|o| {
                o.into_iter()
                    .map(|raw| Buffer {
                        client: self.client.clone(),
                        raw,
                    })
                    .collect()
            })
            .collect();
        let mut first = Ok(());
        for e in events {
            let r = p.await_event(e, "PJRT_Event_Await (execute)");
            if first.is_ok() {
                first = r;
            }
        }
        first.map(|()| outs)
    }
}

impl Drop for Executable {
    fn drop(&mut self) {
        let p = &self.client.plugin;
        let mut a = LoadedExecutableDestroyArgs::new();
        a.executable = self.raw;
        let _ = p.call(
            offset_of!(PjrtApi, loaded_executable_destroy),
            p.api.loaded_executable_destroy,
            "PJRT_LoadedExecutable_Destroy",
            &mut a,
        );
    }
}

/// The plugin the tests and the `pjrt` engine on `device: cpu` use: `TRELLIS_PJRT_CPU_PLUGIN`,
/// else `target/pjrt/xla_cpu_pjrt.so` above the current directory (where `.ci/run` unpacks
/// the `xla-cpu-pjrt` wheel).
pub fn cpu_plugin_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TRELLIS_PJRT_CPU_PLUGIN") {
        return Some(PathBuf::from(p));
    }
    let mut dir = std::env::current_dir().ok()?;
    loop {
        let p = dir.join("target/pjrt/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so");
        if p.is_file() {
            return Some(p);
        }
        if !dir.pop() {
            return None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn cpu_client() -> Option<Client> {
        crate::testing::cpu_client()
    }

    #[test]
    fn a_stablehlo_program_compiles_runs_and_reads_back() {
        let Some(c) = cpu_client() else { return };
        assert_eq!(c.platform(), "cpu");
        let exe = c
            .compile(
                r#"func.func @main(%a: tensor<2x3xf32>, %b: tensor<3x2xf32>) -> (tensor<2x2xf32>, tensor<2x3xf32>) {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<2x3xf32>, tensor<3x2xf32>) -> tensor<2x2xf32>
  %1 = stablehlo.add %a, %a : tensor<2x3xf32>
  return %0, %1 : tensor<2x2xf32>, tensor<2x3xf32>
}"#,
            )
            .unwrap();
        assert_eq!(exe.num_outputs(), 2);
        let a = c.f32(&[1., 2., 3., 4., 5., 6.], &[2, 3]).unwrap();
        let b = c.f32(&[1., 0., 0., 1., 1., 1.], &[3, 2]).unwrap();
        let out = exe.run(&[&a, &b]).unwrap();
        assert_eq!(out[0].dims().unwrap(), vec![2, 2]);
        assert_eq!(out[0].to_f32().unwrap(), vec![4., 5., 10., 11.]);
        assert_eq!(out[1].to_f32().unwrap(), vec![2., 4., 6., 8., 10., 12.]);
        // Buffers stay usable: run again on the same inputs.
        let again = exe.run(&[&a, &b]).unwrap();
        assert_eq!(again[0].to_f32().unwrap(), vec![4., 5., 10., 11.]);
    }

    #[test]
    fn a_replicated_program_sums_across_devices_with_an_all_reduce() {
        let Some(path) = crate::testing::cpu_plugin() else {
            return;
        };
        let plugin = Plugin::load(&path).unwrap();
        let c = Client::with_devices(plugin.clone(), 3).unwrap();
        assert_eq!(c.device_count(), 3);
        let exe = c
            .compile_replicated(
                r#"func.func @main(%a: tensor<2xf32>) -> (tensor<2xf32>, tensor<2xf32>) {
  %0 = "stablehlo.all_reduce"(%a) ({
  ^bb0(%x: tensor<f32>, %y: tensor<f32>):
    %s = stablehlo.add %x, %y : tensor<f32>
    stablehlo.return %s : tensor<f32>
  }) {replica_groups = dense<[[0, 1, 2]]> : tensor<1x3xi64>} : (tensor<2xf32>) -> tensor<2xf32>
  %1 = stablehlo.add %a, %a : tensor<2xf32>
  return %0, %1 : tensor<2xf32>, tensor<2xf32>
}"#,
                3,
            )
            .unwrap();
        let mut on = exe.devices().to_vec();
        on.sort();
        assert_eq!(on, vec![0, 1, 2], "one replica a device");
        let bufs: Vec<Buffer> = exe
            .devices()
            .iter()
            .enumerate()
            .map(|(r, &d)| c.f32_on(d, &[r as f32, 10.0 * r as f32], &[2]).unwrap())
            .collect();
        let out = exe
            .run_replicated(&bufs.iter().map(|b| vec![b]).collect::<Vec<_>>())
            .unwrap();
        assert_eq!(out.len(), 3);
        for (r, o) in out.iter().enumerate() {
            assert_eq!(o[0].to_f32().unwrap(), vec![3.0, 30.0], "replica {r}");
            assert_eq!(
                o[1].to_f32().unwrap(),
                vec![2.0 * r as f32, 20.0 * r as f32]
            );
        }
        let Err(e) = exe.run(&[&bufs[0]]) else {
            panic!("a 3-replica program ran on one argument list");
        };
        assert!(e.to_string().contains("3 replicas"), "{e}");
        let Err(e) = c.compile_replicated("func.func @main() -> () { return }", 4) else {
            panic!("4 replicas compiled on 3 devices");
        };
        assert!(e.to_string().contains("3 devices"), "{e}");
    }

    /// One PJRT client per plugin while a handle lives: handles asking for no more devices
    /// than it has share it (each using its first N); asking for more makes a new one (the CPU
    /// plugin then makes more host devices).
    #[test]
    fn handles_share_the_plugins_client() {
        let Some(path) = crate::testing::cpu_plugin() else {
            return;
        };
        let plugin = Plugin::load(&path).unwrap();
        let four = Client::with_devices(plugin.clone(), 4).unwrap();
        let one = Client::with_devices(plugin.clone(), 1).unwrap();
        let two = four.with_device_count(2).unwrap();
        assert!(one.shares_with(&four) && two.shares_with(&four));
        assert_eq!(
            (one.device_count(), two.device_count(), four.device_count()),
            (1, 2, 4)
        );
        // A one-device handle runs one-replica programs on the shared client's first device.
        let exe = one
            .compile(
                "func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> { return %a : tensor<2xf32> }",
            )
            .unwrap();
        assert_eq!(exe.devices(), [0]);
        let x = one.f32(&[1.0, 2.0], &[2]).unwrap();
        assert_eq!(exe.run(&[&x]).unwrap()[0].to_f32().unwrap(), [1.0, 2.0]);
        assert!(
            one.f32_on(1, &[1.0], &[1]).is_err(),
            "device 1 is not the handle's"
        );
        let more = Client::with_devices(plugin, 5).unwrap();
        assert!(!more.shares_with(&four));
    }

    #[test]
    fn compile_errors_carry_the_plugins_message() {
        let Some(c) = cpu_client() else { return };
        let Err(e) = c.compile(
            "func.func @main(%a: tensor<2xf32>) -> tensor<3xf32> { return %a : tensor<2xf32> }",
        ) else {
            panic!("a mistyped program compiled");
        };
        let s = e.to_string();
        assert!(s.contains("PJRT_Client_Compile"), "{s}");
        assert!(matches!(e, PjrtError::Call { .. }), "{s}");
        let Err(e) = c.f32(&[1.0; 5], &[2, 3]) else {
            panic!("5 values filled a 2x3 buffer");
        };
        let e = e.to_string();
        assert!(e.contains("5 values") && e.contains("[2, 3]"), "{e}");
    }
}
