//! `trellis doctor`: checks a host before it joins a cluster, and says what is wrong and how to
//! fix it: cores, memory, CPU features, `/dev/shm`, open-file limit, PJRT plugins (found where
//! pip puts them, and their API versions), TPU and GPU devices (against what the agent will
//! announce), and the head (reachable, authenticated, same version, clock skew).
//!
//! Owns: the checks. Never: changes the host, or initialises a plugin or a device.

use crate::client::{ClientOptions, connect};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How bad a finding is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// As it should be.
    Ok,
    /// Worth knowing; nothing to fix.
    Info,
    /// Works, but slower or fragile.
    Warn,
    /// Stops this host from doing its part.
    Fail,
}

/// One finding.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// Its verdict.
    pub level: Level,
    /// What was found.
    pub detail: String,
    /// How to fix it, when not ok.
    pub fix: Option<String>,
}

fn check(name: &str, level: Level, detail: String, fix: Option<&str>) -> Check {
    Check {
        name: name.to_string(),
        level,
        detail,
        fix: fix.map(str::to_string),
    }
}

/// What to check besides the host itself.
#[derive(Clone, Debug, Default)]
pub struct DoctorOptions {
    /// The head to reach, with its token.
    pub head: Option<ClientOptions>,
    /// PJRT plugins to probe besides those found in the usual places.
    pub pjrt: Vec<PathBuf>,
    /// What the agent will announce (`--resources`): checked against the devices visible.
    pub resources: Option<actors::Resources>,
}

/// Runs every check.
pub async fn run(opts: &DoctorOptions) -> Vec<Check> {
    let mut out = vec![cores(), memory(), cpu_features(), shm(), open_files()];
    out.extend(plugins(&opts.pjrt));
    out.extend(devices(opts.resources.as_ref()));
    if let Some(head) = &opts.head {
        out.extend(head_checks(head).await);
    }
    out
}

fn cores() -> Check {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    let level = if n >= 2 { Level::Ok } else { Level::Warn };
    check(
        "cores",
        level,
        format!("{n} available to this process"),
        (n < 2).then_some("give the agent more CPUs (its cgroup or container limit)"),
    )
}

/// `MemTotal` and `MemAvailable` from /proc/meminfo, in bytes.
fn meminfo() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb << 10)
    };
    Some((field("MemTotal:")?, field("MemAvailable:")?))
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn memory() -> Check {
    match meminfo() {
        Some((total, avail)) => {
            let low = avail < 4 << 30;
            check(
                "memory",
                if low { Level::Warn } else { Level::Ok },
                format!("{:.1} GiB available of {:.1} GiB", gib(avail), gib(total)),
                low.then_some("free memory or use a larger host: models, KV caches and weight snapshots live in RAM"),
            )
        }
        None => check(
            "memory",
            Level::Warn,
            "cannot read /proc/meminfo".into(),
            None,
        ),
    }
}

fn cpu_features() -> Check {
    #[cfg(target_arch = "x86_64")]
    {
        let has = |f: &str| match f {
            "avx2" => std::arch::is_x86_feature_detected!("avx2"),
            "fma" => std::arch::is_x86_feature_detected!("fma"),
            "avx512f" => std::arch::is_x86_feature_detected!("avx512f"),
            _ => false,
        };
        let present: Vec<&str> = ["avx2", "fma", "avx512f"]
            .into_iter()
            .filter(|f| has(f))
            .collect();
        let fast = has("avx2") && has("fma");
        check(
            "cpu features",
            if fast { Level::Ok } else { Level::Warn },
            if present.is_empty() {
                "no AVX2/FMA/AVX-512".into()
            } else {
                present.join(", ")
            },
            (!fast)
                .then_some("the native CPU kernels are several times slower without AVX2 and FMA"),
        )
    }
    #[cfg(not(target_arch = "x86_64"))]
    check(
        "cpu features",
        Level::Info,
        std::env::consts::ARCH.to_string(),
        None,
    )
}

fn shm() -> Check {
    let dir = Path::new("/dev/shm");
    let probe = dir.join(format!("trellis-doctor-{}", std::process::id()));
    let writable = std::fs::write(&probe, b"x").is_ok();
    let _ = std::fs::remove_file(&probe);
    if !writable {
        return check(
            "/dev/shm",
            Level::Warn,
            "not writable".into(),
            Some(
                "mount a tmpfs at /dev/shm (Kubernetes: an emptyDir with medium: Memory); without it weights between processes of this host go over gRPC",
            ),
        );
    }
    let free = statvfs_free(dir);
    let small = free.is_some_and(|f| f < 1 << 30);
    check(
        "/dev/shm",
        if small { Level::Warn } else { Level::Ok },
        match free {
            Some(f) => format!("writable, {:.1} GiB free", gib(f)),
            None => "writable".into(),
        },
        small.then_some(
            "make /dev/shm at least as large as the model's weights (docker: --shm-size)",
        ),
    )
}

fn statvfs_free(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: a zeroed statvfs is a valid out-parameter; `c` is NUL-terminated.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path pointer and out-pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return None;
    }
    Some(s.f_bavail as u64 * s.f_frsize as u64)
}

fn open_files() -> Check {
    // SAFETY: a zeroed rlimit is a valid out-parameter.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return check(
            "open files",
            Level::Warn,
            "cannot read the limit".into(),
            None,
        );
    }
    let low = r.rlim_cur < 4096;
    check(
        "open files",
        if low { Level::Warn } else { Level::Ok },
        format!("limit {}", r.rlim_cur),
        low.then_some("raise it (`ulimit -n 65536`, or LimitNOFILE= in a systemd unit): every agent connection and checkpoint file takes one"),
    )
}

fn plugins(extra: &[PathBuf]) -> Vec<Check> {
    let mut paths: Vec<PathBuf> = extra.to_vec();
    if let Some(p) = std::env::var_os("TRELLIS_PJRT_PLUGIN") {
        paths.push(PathBuf::from(p));
    }
    for p in libtpu_sys::locate::installed() {
        if !paths.contains(&p) {
            paths.push(p);
        }
    }
    if paths.is_empty() {
        return vec![check(
            "pjrt plugins",
            Level::Info,
            "none found (needed only for `engine: pjrt`)".into(),
            Some(
                "pip install libtpu (TPU), jax-cuda13-pjrt or jax-cuda12-pjrt (GPU), or xla-cpu-pjrt (CPU), or pass --pjrt PATH",
            ),
        )];
    }
    paths
        .iter()
        .map(|p| match libtpu_sys::probe(p) {
            Ok(info) => check(
                "pjrt plugin",
                Level::Ok,
                format!("{}: PJRT C API {}.{}", p.display(), info.major, info.minor),
                None,
            ),
            Err(e) => check(
                "pjrt plugin",
                Level::Fail,
                e.to_string(),
                Some("point --pjrt (or TRELLIS_PJRT_PLUGIN) at a PJRT plugin such as libtpu.so"),
            ),
        })
        .collect()
}

/// TPU chips and NVIDIA GPUs visible as device files.
fn visible_devices() -> (u32, u32) {
    let count = |dir: &str, prefix: &str| -> u32 {
        std::fs::read_dir(dir).map_or(0, |entries| {
            entries
                .flatten()
                .filter(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n.strip_prefix(prefix).is_some_and(|rest| {
                        !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit())
                    })
                })
                .count() as u32
        })
    };
    // TPU v4/v5e expose /dev/accelN; v5p/v6e expose VFIO groups.
    let tpu = count("/dev", "accel").max(count("/dev/vfio", ""));
    let gpu = count("/dev", "nvidia");
    (tpu, gpu)
}

fn devices(announced: Option<&actors::Resources>) -> Vec<Check> {
    let (tpu, gpu) = visible_devices();
    let mut out = Vec::new();
    for (kind, seen, said) in [
        ("tpu", tpu, announced.map(|r| r.tpu)),
        ("gpu", gpu, announced.map(|r| r.gpu)),
    ] {
        let (level, fix) = match said {
            Some(n) if n > seen => (
                Level::Fail,
                Some(format!(
                    "--resources announces {kind}={n} but {seen} are visible: announce {kind}={seen}, or give the agent's container the devices"
                )),
            ),
            Some(n) if n < seen => (
                Level::Info,
                Some(format!(
                    "{seen} visible, {n} announced: the rest stay unused"
                )),
            ),
            _ => (if seen > 0 { Level::Ok } else { Level::Info }, None),
        };
        out.push(Check {
            name: format!("{kind} devices"),
            level,
            detail: match said {
                Some(n) => format!("{seen} visible, {n} announced"),
                None => format!("{seen} visible"),
            },
            fix,
        });
    }
    out
}

async fn head_checks(opts: &ClientOptions) -> Vec<Check> {
    let mut client = match connect(opts).await {
        Ok(c) => c,
        Err(e) => {
            return vec![check(
                "head",
                Level::Fail,
                e.to_string(),
                Some("start `trellis serve` there, or fix --head (and any firewall between)"),
            )];
        }
    };
    let sent = SystemTime::now();
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        client.get_cluster(proto::v1::GetClusterRequest {}),
    )
    .await;
    let received = SystemTime::now();
    let info = match reply {
        Ok(Ok(r)) => r.into_inner(),
        Ok(Err(s)) => {
            let fix = if s.code() == tonic::Code::Unauthenticated {
                "pass --token-file with the head's agents' token (its DATA_DIR/agent-token) or the admin's (DATA_DIR/token)"
            } else {
                "check the head's log"
            };
            return vec![check(
                "head",
                Level::Fail,
                format!("{}: {}", opts.server, s.message()),
                Some(fix),
            )];
        }
        Err(_) => {
            return vec![check(
                "head",
                Level::Fail,
                format!("{}: no answer within 10 s", opts.server),
                Some("check the network path to the head"),
            )];
        }
    };
    let ms = |t: SystemTime| {
        t.duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64)
    };
    let rtt = ms(received) - ms(sent);
    let skew = info.time_ms as i64 - (ms(sent) + ms(received)) / 2;
    let ours = env!("CARGO_PKG_VERSION");
    let mut out = vec![check(
        "head",
        Level::Ok,
        format!(
            "{} answers (round trip {rtt} ms, {} agents registered)",
            opts.server,
            info.agents.len()
        ),
        None,
    )];
    let same = info.version == ours && info.protocol_version == actors::head::PROTOCOL_VERSION;
    out.push(check(
        "version",
        if same { Level::Ok } else { Level::Fail },
        format!(
            "head {} (protocol {}), this host {ours} (protocol {})",
            info.version,
            info.protocol_version,
            actors::head::PROTOCOL_VERSION
        ),
        (!same).then_some("run the same trellis release on every host"),
    ));
    let level = match skew.unsigned_abs() {
        0..=1000 => Level::Ok,
        1001..=30_000 => Level::Warn,
        _ => Level::Fail,
    };
    out.push(check(
        "clock skew",
        level,
        format!("{skew:+} ms against the head (± {} ms)", rtt / 2 + 1),
        (level != Level::Ok).then_some("run NTP (chrony, systemd-timesyncd) on every host: job records and timeouts compare times across hosts"),
    ));
    out
}
