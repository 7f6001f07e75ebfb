//! With the `cuda` feature, compiles the optimiser's CUDA kernels (`src/cuda_update.cu`) to PTX
//! (the kernels crate's rule, `../kernels/ptx.rs`). Without the feature this does nothing.

include!("../kernels/ptx.rs");

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=../kernels/ptx.rs");
    compile_ptx("src/cuda_update.cu", "update.ptx");
}
