//! The Makefile builds the CUDA binary for the GPUs the machine has: the compute capability
//! `nvidia-smi` reports (a fake one on PATH here), the lowest of several, 80 without a GPU,
//! and `CUDA_COMPUTE_CAP` over all of them. `make -n` prints the commands without running them.

use std::path::Path;
use std::process::Command;

use bertkit_test_support::repo_root;

/// `make -n build-train` with an `nvidia-smi` that lists `caps` (none: fails, no GPU), plus `env`.
fn build_train_commands(caps: &[&str], env: &[(&str, &str)]) -> String {
    let bin = tempfile::tempdir().unwrap();
    // Without GPUs, nvidia-smi fails as it does on a machine without the driver (and hides a
    // real one on this machine's PATH).
    let script = if caps.is_empty() {
        "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n".to_string()
    } else {
        format!(
            "#!/bin/sh\ncase \"$*\" in\n  *compute_cap*) printf '{}\\n' ;;\n  *-L*) echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)' ;;\nesac\n",
            caps.join("\\n")
        )
    };
    let fake = bin.path().join("nvidia-smi");
    std::fs::write(&fake, script).unwrap();
    make_executable(&fake);
    let path = format!(
        "{}:{}",
        bin.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut command = Command::new("make");
    command
        .args(["-s", "-n", "build-train", "FEATURES=cuda"])
        .current_dir(repo_root())
        .env("PATH", path)
        .env_remove("CUDA_COMPUTE_CAP")
        .env_remove("MAKEFLAGS");
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().expect("make runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[cfg(unix)]
fn make_executable(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The compute capability the printed cargo build line is given.
fn built_for(commands: &str) -> &str {
    let line = commands
        .lines()
        .find(|l| l.contains(" build --release --locked --features cuda "))
        .unwrap_or_else(|| panic!("no CUDA build line in: {commands}"));
    line.strip_prefix("CUDA_COMPUTE_CAP=")
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("the build line sets no CUDA_COMPUTE_CAP: {line}"))
}

#[test]
fn the_cuda_build_targets_the_gpus_compute_capability() {
    let hopper = build_train_commands(&["9.0"], &[]);
    assert!(
        hopper.contains("compute capability 90 (nvidia-smi)") && built_for(&hopper) == "90",
        "{hopper}"
    );
    // An A100 beside H100s: the A100's code runs on both.
    let mixed = build_train_commands(&["9.0", "8.0", "9.0"], &[]);
    assert_eq!(built_for(&mixed), "80");
    let none = build_train_commands(&[], &[]);
    assert!(
        none.contains("compute capability 80 (no GPU found: the default)")
            && built_for(&none) == "80",
        "{none}"
    );
    let asked = build_train_commands(&["8.0"], &[("CUDA_COMPUTE_CAP", "90")]);
    assert!(
        asked.contains("compute capability 90 (CUDA_COMPUTE_CAP)") && built_for(&asked) == "90",
        "{asked}"
    );
}
