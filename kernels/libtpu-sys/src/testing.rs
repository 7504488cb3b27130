//! For tests only: the XLA CPU plugin every pjrt test runs on. A test asks
//! for it and gets it: found where `.ci/setup` unpacks the wheel, or fetched by running
//! `.ci/setup xla` the first time. A test is skipped only when `TRELLIS_SKIP_PJRT=1` asks for it
//! (and says so); a plugin that cannot be had otherwise fails the test with the command that
//! fetches it. Never a silent pass.

use crate::pjrt::{Client, cpu_plugin_path};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The workspace root (this crate is `kernels/libtpu-sys`).
fn workspace() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    root.canonicalize().unwrap_or(root)
}

/// The XLA CPU plugin, fetched once per process when it is missing; `None` when
/// `TRELLIS_SKIP_PJRT` asks to skip.
pub fn cpu_plugin() -> Option<PathBuf> {
    static FOUND: OnceLock<Option<PathBuf>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            if std::env::var_os("TRELLIS_SKIP_PJRT").is_some_and(|v| v == "1") {
                #[allow(clippy::print_stderr)] // a skip says so
                {
                    eprintln!("*** SKIPPED: TRELLIS_SKIP_PJRT=1 skips the pjrt tests ***");
                }
                return None;
            }
            let root = workspace();
            let found = || {
                cpu_plugin_path().or_else(|| {
                    let p = root.join("target/pjrt/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so");
                    p.is_file().then_some(p)
                })
            };
            if let Some(p) = found() {
                return Some(p);
            }
            let setup = root.join(".ci/setup");
            let ran = std::process::Command::new(&setup).arg("xla").status();
            match (ran, found()) {
                (Ok(s), Some(p)) if s.success() => Some(p),
                (ran, _) => panic!(
                    "the XLA CPU plugin is missing and `{} xla` could not fetch it ({}): run it by hand (it needs python3 with pip, and PyPI), point TRELLIS_PJRT_CPU_PLUGIN at xla_cpu_pjrt.so, or set TRELLIS_SKIP_PJRT=1 to skip these tests",
                    setup.display(),
                    match ran {
                        Ok(s) => s.to_string(),
                        Err(e) => e.to_string(),
                    }
                ),
            }
        })
        .clone()
}

/// A client of the XLA CPU plugin (see [`cpu_plugin`]).
pub fn cpu_client() -> Option<Client> {
    cpu_client_of(1)
}

/// A client of `devices` host devices of the XLA CPU plugin (see [`cpu_plugin`]), for
/// replicated programs.
pub fn cpu_client_of(devices: usize) -> Option<Client> {
    let p = cpu_plugin()?;
    let plugin = crate::pjrt::Plugin::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    Some(Client::with_devices(plugin, devices).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
}
