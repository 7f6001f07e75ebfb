//! With the `cuda` feature, compiles the optimiser's CUDA kernels (`src/cuda_update.cu`) to PTX
//! (the model crate's rule, `../model/ptx.rs`). Without the feature this does nothing.

include!("../model/ptx.rs");

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=../model/ptx.rs");
    compile_ptx("src/cuda_update.cu", "update.ptx");
}
