//! The deployment files in `deploy/`: every Kubernetes manifest parses and agrees with the
//! binary (flags `trellis serve`/`trellis agent --help` list, device counts announced equal to
//! devices requested, Service/probe/Secret/volume names that match), and the Slurm script runs
//! end to end on this machine with `srun` and `scontrol` stand-ins: head, two agents, a job, then
//! the same allocation requeued (no second copy of the job); the Dockerfile has an image per
//! accelerator kind with its PJRT plugin.

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use trellis_tests::{run_ok, trellis, trellis_bin};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every document of every manifest, with its file name.
fn manifests() -> Vec<(String, Value)> {
    let dir = root().join("deploy/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "{files:?}");
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        for (i, doc) in text.split("\n---\n").enumerate() {
            let v: Value =
                serde_saphyr::from_str(doc).unwrap_or_else(|e| panic!("{name} document {i}: {e}"));
            for key in ["apiVersion", "kind"] {
                assert!(v[key].is_string(), "{name} document {i}: no {key}");
            }
            assert!(v["metadata"]["name"].is_string(), "{name}: unnamed");
            if v["kind"] != "Namespace" {
                assert_eq!(v["metadata"]["namespace"], "trellis", "{name}");
            }
            out.push((name.clone(), v));
        }
    }
    out
}

/// The long options `trellis SUB --help` lists.
fn flags(sub: &str) -> Vec<String> {
    let out = run_ok(trellis().args([sub, "--help"]));
    let help = String::from_utf8(out.stdout).unwrap();
    help.split_whitespace()
        .filter(|w| w.starts_with("--"))
        .map(|w| {
            w.trim_end_matches([',', '.', ')'])
                .split(['=', '['])
                .next()
                .unwrap()
                .to_string()
        })
        .collect()
}

/// The value after `flag` in `args`.
fn arg<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|a| match a {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
        .collect()
}

fn quantity(v: &Value) -> Option<u64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

#[test]
fn kubernetes_manifests_agree_with_the_binary_and_each_other() {
    let docs = manifests();
    let by_kind = |kind: &str| -> Vec<&Value> {
        docs.iter()
            .filter(|(_, v)| v["kind"] == kind)
            .map(|(_, v)| v)
            .collect()
    };
    let serve_flags = flags("serve");
    let agent_flags = flags("agent");

    // The head: one replica, recreated (one process holds the store), data on the claim.
    let heads = by_kind("Deployment");
    assert_eq!(heads.len(), 1);
    let head = heads[0];
    assert_eq!(head["spec"]["replicas"], 1);
    assert_eq!(head["spec"]["strategy"]["type"], "Recreate");
    let pod = &head["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert!(c["image"].as_str().unwrap().ends_with("-cpu"), "{c}");
    let args = strings(&c["args"]);
    assert_eq!(args[0], "serve");
    for a in args.iter().filter(|a| a.starts_with("--")) {
        assert!(serve_flags.contains(a), "trellis serve has no {a}");
    }
    let listen = arg(&args, "--listen").unwrap();
    let port: u64 = listen.rsplit(':').next().unwrap().parse().unwrap();
    assert!(listen.starts_with("0.0.0.0:"), "the head must be reachable");
    let ports = c["ports"].as_array().unwrap();
    assert!(
        ports
            .iter()
            .any(|p| p["containerPort"] == port && p["name"] == "grpc")
    );
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(c[probe]["grpc"]["port"], port, "{probe}");
    }
    assert_eq!(
        c["readinessProbe"]["grpc"]["service"], "trellis.v1.JobService",
        "the service the head's health service reports"
    );
    let claims = by_kind("PersistentVolumeClaim");
    let volumes = pod["volumes"].as_array().unwrap();
    let data_volume = volumes
        .iter()
        .find(|v| v["persistentVolumeClaim"]["claimName"] == claims[0]["metadata"]["name"])
        .expect("the data dir is on the claim");
    let mounts = c["volumeMounts"].as_array().unwrap();
    let data_mount = mounts
        .iter()
        .find(|m| m["name"] == data_volume["name"])
        .unwrap();
    assert_eq!(
        data_mount["mountPath"].as_str(),
        arg(&args, "--data-dir"),
        "--data-dir is the claim's mount"
    );

    // The Service selects the head's pods on its port.
    let services = by_kind("Service");
    assert_eq!(services.len(), 1);
    let svc = services[0];
    let labels = &head["spec"]["template"]["metadata"]["labels"];
    for (k, v) in svc["spec"]["selector"].as_object().unwrap() {
        assert_eq!(&labels[k], v, "Service selector {k}");
    }
    assert_eq!(svc["spec"]["ports"][0]["port"], port);
    let head_url = format!(
        "http://{}.{}.svc:{port}",
        svc["metadata"]["name"].as_str().unwrap(),
        svc["metadata"]["namespace"].as_str().unwrap()
    );

    // Agents: flags the binary has, the head's address, announced devices = requested devices.
    let agents = by_kind("DaemonSet");
    assert!(agents.len() >= 3, "TPU, GPU and CPU agents");
    let mut devices_seen = BTreeMap::new();
    for ds in &agents {
        let name = ds["metadata"]["name"].as_str().unwrap();
        let spec = &ds["spec"]["template"]["spec"];
        for (k, v) in ds["spec"]["selector"]["matchLabels"].as_object().unwrap() {
            assert_eq!(
                &ds["spec"]["template"]["metadata"]["labels"][k], v,
                "{name}"
            );
        }
        let c = &spec["containers"][0];
        let args = strings(&c["args"]);
        assert_eq!(args[0], "agent", "{name}");
        for a in args.iter().filter(|a| a.starts_with("--")) {
            assert!(agent_flags.contains(a), "{name}: trellis agent has no {a}");
        }
        assert_eq!(arg(&args, "--head"), Some(head_url.as_str()), "{name}");
        let listen = arg(&args, "--listen").unwrap();
        let agent_port: u64 = listen.rsplit(':').next().unwrap().parse().unwrap();
        assert!(
            c["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["containerPort"] == agent_port),
            "{name}"
        );
        assert!(
            arg(&args, "--advertise").is_some_and(|a| a.ends_with(&format!(":{agent_port}"))),
            "{name}: the head reaches the agent on its listen port"
        );
        let announced: BTreeMap<String, String> = arg(&args, "--resources")
            .unwrap()
            .split(',')
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                (k.to_string(), v.to_string())
            })
            .collect();
        let requests = &c["resources"]["requests"];
        let limits = &c["resources"]["limits"];
        for (kind, k8s) in [("tpu", "google.com/tpu"), ("gpu", "nvidia.com/gpu")] {
            let said: Option<u64> = announced.get(kind).map(|v| v.parse().unwrap());
            let asked = quantity(&requests[k8s]);
            assert_eq!(said.filter(|&n| n > 0), asked, "{name}: {kind}= vs {k8s}");
            assert_eq!(
                asked,
                quantity(&limits[k8s]),
                "{name}: {k8s} request = limit"
            );
            if let Some(n) = asked {
                devices_seen.insert(kind, n);
            }
        }
        // The image carries the plugin of the devices the agent announces.
        let image = c["image"].as_str().unwrap();
        let want = if announced.contains_key("tpu") {
            "-tpu"
        } else if announced.contains_key("gpu") {
            "-cuda"
        } else {
            "-cpu"
        };
        assert!(
            image.ends_with(want),
            "{name}: image {image} is not the {want} one"
        );
        assert_eq!(
            announced.get("cpu").and_then(|v| v.parse().ok()),
            quantity(&requests["cpu"]),
            "{name}: cpu= vs the cpu request"
        );
        // The token: the Secret's volume, mounted where --token-file points.
        let token = arg(&args, "--token-file").unwrap();
        let vol = spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["secret"]["secretName"] == "trellis-token")
            .unwrap_or_else(|| panic!("{name}: no token volume"));
        let mount = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == vol["name"])
            .unwrap();
        assert!(
            token.starts_with(mount["mountPath"].as_str().unwrap()),
            "{name}: --token-file {token} is not in the Secret's mount"
        );
    }
    assert_eq!(
        devices_seen.len(),
        2,
        "a TPU and a GPU pool: {devices_seen:?}"
    );
    // The head reads the same Secret.
    let token = arg(&args, "--token-file").unwrap();
    let vol = volumes
        .iter()
        .find(|v| v["secret"]["secretName"] == "trellis-token")
        .unwrap();
    let mount = mounts.iter().find(|m| m["name"] == vol["name"]).unwrap();
    assert!(token.starts_with(mount["mountPath"].as_str().unwrap()));

    // The README walks through every manifest.
    let readme = std::fs::read_to_string(root().join("deploy/kubernetes/README.md")).unwrap();
    for (file, _) in &docs {
        assert!(
            readme.contains(file.as_str()),
            "README does not mention {file}"
        );
    }
}

/// The images `deploy/Dockerfile` builds (docker is not run here: CI has no daemon and no
/// registry): a target per accelerator kind, each pip-installing into the venv `trellis`
/// searches (VIRTUAL_ENV) the wheel whose plugin `libtpu_sys::locate` finds for its devices,
/// each with the binary and the recipes; the build context leaves out `target/`.
#[test]
fn the_dockerfile_has_an_image_per_accelerator_with_its_plugin() {
    use libtpu_sys::locate::{Device, wheels};
    let text = std::fs::read_to_string(root().join("deploy/Dockerfile")).unwrap();
    // Stages by name: their lines (continuations joined).
    let mut stages: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current = String::new();
    let joined = text.replace("\\\n", " ");
    for line in joined.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("FROM ") {
            current = rest
                .split_once(" AS ")
                .map(|(_, name)| name.trim().to_string())
                .unwrap_or_default();
        }
        stages
            .entry(current.clone())
            .or_default()
            .push(line.to_string());
    }
    for (target, device) in [
        ("cpu", Device::Cpu),
        ("cuda", Device::Gpu),
        ("tpu", Device::Tpu),
    ] {
        let lines = stages
            .get(target)
            .unwrap_or_else(|| panic!("no `{target}` target in deploy/Dockerfile"));
        let has = |s: &str| lines.iter().any(|l| l.contains(s));
        assert!(has("ENV VIRTUAL_ENV=/opt/venv"), "{target}: {lines:#?}");
        let pip = lines
            .iter()
            .find(|l| l.contains("python3 -m venv /opt/venv") && l.contains("pip install"))
            .unwrap_or_else(|| panic!("{target}: no pip install into /opt/venv"));
        let wheel = pip
            .split_whitespace()
            .last()
            .unwrap()
            .split("==")
            .next()
            .unwrap();
        assert!(
            wheels(device).split([' ', '(', ')']).any(|w| w == wheel),
            "{target}: {wheel} is not a plugin wheel for {device:?} ({})",
            wheels(device)
        );
        assert!(
            has("COPY --from=build /src/target/release/trellis /usr/local/bin/trellis"),
            "{target}"
        );
        assert!(has("COPY recipes /opt/trellis/recipes"), "{target}");
        assert!(has(r#"ENTRYPOINT ["/usr/local/bin/trellis"]"#), "{target}");
    }
    let ignore = std::fs::read_to_string(root().join(".dockerignore")).unwrap();
    assert!(ignore.lines().any(|l| l.trim() == "target/"), "{ignore}");
    // The README builds each of them.
    let readme = std::fs::read_to_string(root().join("deploy/kubernetes/README.md")).unwrap();
    assert!(readme.contains("for kind in cpu cuda tpu"), "{readme}");
}

fn write_exe(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn the_slurm_script_starts_a_head_and_agents_and_runs_the_job() {
    let dir = std::env::temp_dir().join(format!("trellis-slurm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let shims = dir.join("bin");
    std::fs::create_dir_all(&shims).unwrap();
    // A two-node allocation on this machine: `srun` runs its command once per node (in the
    // background, signals passed on), each "node" named by `hostname`.
    write_exe(
        &shims.join("srun"),
        r#"#!/bin/bash
n=1
while [[ $# -gt 0 && $1 == --* ]]; do
    case $1 in --nodes=*) n=${1#--nodes=} ;; esac
    shift
done
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' TERM INT
for i in $(seq 0 $((n - 1))); do
    SLURM_NODEID=$i "$@" &
    pids+=($!)
done
wait
"#,
    );
    write_exe(
        &shims.join("scontrol"),
        "#!/bin/sh\n[ \"$1 $2\" = \"show hostnames\" ] && printf 'localhost\\nlocalhost\\n'\n",
    );
    write_exe(
        &shims.join("hostname"),
        "#!/bin/sh\necho \"node${SLURM_NODEID:-x}\"\n",
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let path = format!(
        "{}:{}",
        shims.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let sbatch = |restart: Option<&str>| {
        let mut cmd = Command::new("bash");
        cmd.arg(root().join("deploy/slurm/trellis.sbatch"))
            .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tiny-arith.yaml"))
            .args([
                "-o",
                "pools.rollout.count=2",
                "-o",
                "pools.rollout.placement=spread",
                "-o",
                "stages.rl.trainer.steps=2",
            ])
            .env("PATH", &path)
            .env("TRELLIS", trellis_bin())
            .env("TRELLIS_DATA", dir.join("data"))
            .env("TRELLIS_PORT", port.to_string())
            .env("TRELLIS_LOG", "warn")
            .env("SLURM_JOB_ID", "42")
            .env("SLURM_JOB_NODELIST", "node[0-1]")
            .env("SLURM_JOB_NUM_NODES", "2")
            .env("SLURM_CPUS_ON_NODE", "1")
            .env_remove("TRELLIS_TOKEN_FILE")
            .env_remove("TRELLIS_SERVER")
            .stdin(Stdio::null());
        if let Some(n) = restart {
            cmd.env("SLURM_RESTART_COUNT", n);
        }
        let out = cmd.output().unwrap();
        let log = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), log)
    };
    let t0 = std::time::Instant::now();
    let (ok, log) = sbatch(None);
    eprintln!("the script ran {:.1} s", t0.elapsed().as_secs_f64());
    assert!(ok, "{log}");
    assert!(log.contains("2 agents registered"), "{log}");
    assert!(
        log.contains("rollout pool: node0, node1") || log.contains("rollout pool: node1, node0"),
        "{log}"
    );
    assert!(log.contains("job 1 succeeded"), "{log}");
    // Slurm requeues the allocation (same job id, same data dir): the script follows the job the
    // head already holds instead of submitting a second copy.
    let (ok, log) = sbatch(Some("1"));
    assert!(ok, "{log}");
    assert!(
        log.contains("restart 1 of this allocation: following job 1"),
        "{log}"
    );
    assert!(log.contains("job 1 succeeded"), "{log}");
    assert!(!log.contains("job 2"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}
