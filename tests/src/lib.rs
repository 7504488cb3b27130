//! Helpers for Trellis's end-to-end tests (the tests themselves are in `tests/tests/`): they
//! drive the real `trellis` binary and real processes, never in-process shortcuts.
//!
//! Never: used by product code.

use std::path::PathBuf;
use std::process::Command;

/// Path to the `trellis` binary built from this workspace, building it if it is missing.
///
/// `cargo test --workspace` builds it already (the orchestrator package has integration
/// tests); running this crate's tests alone builds it here with the same profile.
pub fn trellis_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>/trellis
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test executable lives in target/<profile>/deps");
    let bin = profile_dir.join(format!("trellis{}", std::env::consts::EXE_SUFFIX));
    if !bin.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-p", "orchestrator", "--bin", "trellis"]);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd
            .status()
            .expect("run cargo build for the trellis binary");
        assert!(status.success(), "building the trellis binary failed");
    }
    bin
}

/// A `Command` for the `trellis` binary.
pub fn trellis() -> Command {
    Command::new(trellis_bin())
}
