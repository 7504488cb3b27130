//! Makes `cargo test` build the `trellis` binary (Cargo builds a package's binaries for its
//! integration tests), and checks that it starts.

#[test]
fn binary_starts() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_trellis"))
        .arg("--version")
        .output()
        .expect("run trellis");
    assert!(out.status.success(), "{out:?}");
}
