//! Finding a PJRT plugin for a kind of device and opening a client on it: `TRELLIS_PJRT_PLUGIN`,
//! else the plugin pip installed for the device (`libtpu`, `jax-cuda12-pjrt`,
//! `jax-cuda13-pjrt`, `xla-cpu-pjrt`) in the site-packages of the Pythons this host likely
//! uses; the client is checked to run on that kind of device.
//!
//! Owns: plugin discovery and the device check. Never: decides which device a pool uses (the
//! workflow does).

use crate::pjrt::{Client, PjrtError};
use std::fmt;
use std::path::{Path, PathBuf};

/// A kind of device a plugin drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The host's CPU (the XLA CPU plugin).
    Cpu,
    /// NVIDIA (CUDA 12 or 13) or AMD (ROCm) GPUs.
    Gpu,
    /// TPU chips (libtpu).
    Tpu,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
            Device::Tpu => "tpu",
        })
    }
}

/// Where pip puts PJRT plugins, relative to a site-packages folder, with their device (the
/// newer CUDA first).
pub const PLUGIN_PATHS: [(Device, &str); 4] = [
    (Device::Tpu, "libtpu/libtpu.so"),
    (Device::Gpu, "jax_plugins/xla_cuda13/xla_cuda_plugin.so"),
    (Device::Gpu, "jax_plugins/xla_cuda12/xla_cuda_plugin.so"),
    (Device::Cpu, "xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so"),
];

/// The wheels that carry the plugins of `device`, for messages.
pub fn wheels(device: Device) -> &'static str {
    match device {
        Device::Tpu => "libtpu",
        Device::Gpu => "jax-cuda13-pjrt (or jax-cuda12-pjrt)",
        Device::Cpu => "xla-cpu-pjrt",
    }
}

/// site-packages folders of the Pythons this host likely uses.
pub fn site_packages() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["/usr/lib", "/usr/local/lib", "/opt/conda/lib"]
        .iter()
        .map(PathBuf::from)
        .collect();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var) {
            roots.push(PathBuf::from(v).join("lib"));
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    let mut out = Vec::new();
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("python3") {
                for sub in ["site-packages", "dist-packages"] {
                    let p = e.path().join(sub);
                    if p.is_dir() {
                        out.push(p);
                    }
                }
            }
        }
    }
    out
}

/// Every plugin pip installed on this host.
pub fn installed() -> Vec<PathBuf> {
    site_packages()
        .iter()
        .flat_map(|site| PLUGIN_PATHS.iter().map(move |(_, rel)| site.join(rel)))
        .filter(|p| p.is_file())
        .collect()
}

/// The PJRT plugin for `device`: `TRELLIS_PJRT_PLUGIN`, else the one pip installed for it (for
/// the CPU also the wheel `.ci/run` unpacks under `target/pjrt`).
pub fn find_plugin(device: Device) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TRELLIS_PJRT_PLUGIN") {
        return Some(PathBuf::from(p));
    }
    if device == Device::Cpu
        && let Some(p) = crate::pjrt::cpu_plugin_path()
    {
        return Some(p);
    }
    find_in(device, &site_packages())
}

/// The plugin of `device` pip installed in one of `sites` (site-packages folders).
pub fn find_in(device: Device, sites: &[PathBuf]) -> Option<PathBuf> {
    sites
        .iter()
        .flat_map(|site| {
            PLUGIN_PATHS
                .iter()
                .filter(|(d, _)| *d == device)
                .map(move |(_, rel)| site.join(rel))
        })
        .find(|p| p.is_file())
}

/// Why no client could be had for a device.
#[derive(Debug, thiserror::Error)]
pub enum LocateError {
    /// No plugin was found for the device.
    #[error(
        "no PJRT plugin for {device} was found: set the pool's plugin or TRELLIS_PJRT_PLUGIN to its .so, or `pip install {wheels}`"
    )]
    NotFound {
        /// The device.
        device: Device,
        /// The wheels that carry one.
        wheels: &'static str,
    },
    /// The plugin could not be loaded or refused to start.
    #[error("{}: {source}", path.display())]
    Plugin {
        /// The plugin.
        path: PathBuf,
        /// What it said.
        source: PjrtError,
    },
    /// The plugin runs on another kind of device.
    #[error("the device is {device} but the plugin {} runs on `{platform}`", path.display())]
    WrongDevice {
        /// The device wanted.
        device: Device,
        /// The plugin.
        path: PathBuf,
        /// Its platform.
        platform: String,
    },
}

/// A client of `plugin` (default: [`find_plugin`]), checked to run on `device`.
pub fn open(device: Device, plugin: Option<&Path>) -> Result<Client, LocateError> {
    open_devices(device, plugin, 1)
}

/// A client of the first `devices` devices `plugin` sees (default: [`find_plugin`]), checked
/// to run on `device`: for data parallelism over them. The XLA CPU plugin makes that many
/// host devices; a TPU host or a GPU node must have them.
pub fn open_devices(
    device: Device,
    plugin: Option<&Path>,
    devices: usize,
) -> Result<Client, LocateError> {
    let path = match plugin {
        Some(p) => p.to_path_buf(),
        None => find_plugin(device).ok_or(LocateError::NotFound {
            device,
            wheels: wheels(device),
        })?,
    };
    let fail = |source: PjrtError| LocateError::Plugin {
        path: path.clone(),
        source,
    };
    crate::probe(&path).map_err(|e| fail(e.into()))?;
    let client = crate::pjrt::Plugin::load(&path)
        .and_then(|p| Client::with_devices(p, devices))
        .map_err(fail)?;
    let platform = client.platform().to_string();
    let fits = match device {
        Device::Gpu => ["cuda", "rocm", "gpu"].contains(&platform.as_str()),
        Device::Cpu => platform == "cpu",
        Device::Tpu => platform == "tpu",
    };
    if !fits {
        return Err(LocateError::WrongDevice {
            device,
            path,
            platform,
        });
    }
    Ok(client)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugin_pip_installed_for_a_device_is_found_cuda_13_before_12() {
        let site = std::env::temp_dir().join(format!("trellis-site-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&site);
        let put = |rel: &str| {
            let p = site.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"").unwrap();
            p
        };
        let sites = [site.clone()];
        assert_eq!(find_in(Device::Gpu, &sites), None);
        let cuda12 = put("jax_plugins/xla_cuda12/xla_cuda_plugin.so");
        assert_eq!(find_in(Device::Gpu, &sites), Some(cuda12));
        let cuda13 = put("jax_plugins/xla_cuda13/xla_cuda_plugin.so");
        assert_eq!(find_in(Device::Gpu, &sites), Some(cuda13));
        let tpu = put("libtpu/libtpu.so");
        assert_eq!(find_in(Device::Tpu, &sites), Some(tpu));
        assert_eq!(
            find_in(Device::Cpu, &sites),
            None,
            "a GPU plugin is not the CPU's"
        );
        let _ = std::fs::remove_dir_all(&site);
    }
}
