//! With the `cuda` feature, compiles the fused CUDA kernels (`src/kernels/cuda/kernels.cu`) to
//! PTX with nvcc, as candle compiles its own; the PTX is embedded and loaded on the device at
//! the first launch. Without the feature this does nothing (the CPU build needs no CUDA).

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src/kernels/cuda/kernels.cu");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=NVCC");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("kernels.ptx");
    // The architecture candle's kernels are built for (the same variable), so one binary's PTX
    // agrees; the driver compiles it for a newer GPU when loaded.
    let cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".to_string());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let nvcc = env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    let status = Command::new(&nvcc)
        .args(["-ptx", "-O3", "-std=c++17", "--expt-relaxed-constexpr"])
        .arg(format!("-arch=sm_{cap}"))
        .arg("src/kernels/cuda/kernels.cu")
        .arg("-o")
        .arg(&out)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{nvcc} failed ({s}) compiling src/kernels/cuda/kernels.cu"),
        Err(e) => panic!(
            "the cuda feature needs nvcc ({nvcc}: {e}); see ../shared/cuda/setup-cuda-build.sh or set NVCC"
        ),
    }
}
