//! The binary's front door: help and version.

use trellis_tests::trellis;

#[test]
fn version_prints_the_crate_version_and_commit() {
    let out = trellis().arg("--version").output().expect("run trellis");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    // The commit the binary was built from (the checkout's HEAD; `unknown` outside git).
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or("unknown".to_string(), |o| {
            String::from_utf8_lossy(&o.stdout).trim().to_string()
        });
    assert_eq!(
        text.trim(),
        format!("trellis {} ({head})", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn help_names_the_product() {
    let out = trellis().arg("--help").output().expect("run trellis");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("RL post-training"), "{text}");
}
