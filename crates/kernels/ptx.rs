// Compiling CUDA C to PTX for a build script, shared by the crates that have CUDA kernels
// (`include!`d by their build.rs, so the rule is written once and no build dependency is
// added): nvcc, the compute capability candle's kernels are built for.

/// Compiles `source` (relative to the crate) to `$OUT_DIR/<out>` with nvcc when the `cuda`
/// feature is on; does nothing otherwise (the CPU build needs no CUDA).
#[allow(dead_code)]
fn compile_ptx(source: &str, out: &str) {
    println!("cargo::rerun-if-changed={source}");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join(out);
    // The architecture candle's kernels are built for (the same variable), so one binary's
    // PTX agrees; the driver compiles it for a newer GPU when loaded.
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".to_string());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    let status = std::process::Command::new(&nvcc)
        .args(["-ptx", "-O3", "-std=c++17", "--expt-relaxed-constexpr"])
        .arg(format!("-arch=sm_{cap}"))
        .arg(source)
        .arg("-o")
        .arg(&out)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{nvcc} failed ({s}) compiling {source}"),
        Err(e) => panic!(
            "the cuda feature needs nvcc ({nvcc}: {e}); see ../shared/cuda/setup-cuda-build.sh or set NVCC"
        ),
    }
}
