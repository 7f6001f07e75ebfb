//! With the `cuda` feature, compiles the fused CUDA kernels (`src/cuda/kernels.cu`) to
//! PTX with nvcc, as candle compiles its own; the PTX is embedded and loaded on the device at
//! the first launch. Without the feature this does nothing (the CPU build needs no CUDA).

include!("ptx.rs");

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=ptx.rs");
    // kernels.cu includes these.
    println!("cargo::rerun-if-changed=src/cuda/common.cuh");
    println!("cargo::rerun-if-changed=src/cuda/norm.cu");
    println!("cargo::rerun-if-changed=src/cuda/flash.cu");
    println!("cargo::rerun-if-changed=src/cuda/flash_registers.cu");
    println!("cargo::rerun-if-changed=src/cuda/tensor_core.cuh");
    println!("cargo::rerun-if-changed=src/cuda/loss.cu");
    compile_ptx("src/cuda/kernels.cu", "kernels.ptx");
}
