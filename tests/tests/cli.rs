//! The binary's front door: help and version.

use trellis_tests::trellis;

#[test]
fn version_prints_the_crate_version() {
    let out = trellis().arg("--version").output().expect("run trellis");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.trim(),
        format!("trellis {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn help_names_the_product() {
    let out = trellis().arg("--help").output().expect("run trellis");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("RL post-training"), "{text}");
}
