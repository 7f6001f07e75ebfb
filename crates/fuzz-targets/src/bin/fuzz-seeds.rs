//! Writes every target's seeds under a folder (`make fuzz` gives `fuzz/seeds`): one file per
//! seed in `<folder>/<target>/`, named by its SHA-256 as libFuzzer names corpus files.

use bertkit_fuzz_targets::{TARGETS, seeds::seeds};

fn main() {
    let Some(out) = std::env::args_os().nth(1) else {
        eprintln!("usage: fuzz-seeds FOLDER");
        std::process::exit(2);
    };
    let out = std::path::PathBuf::from(out);
    for t in TARGETS {
        let dir = out.join(t.name);
        if let Err(e) = std::fs::create_dir_all(&dir) {
            eprintln!("error: creating {}: {e}", dir.display());
            std::process::exit(1);
        }
        let inputs = seeds(t.name);
        for input in &inputs {
            let path = dir.join(bertkit_test_support::sha256_hex(input));
            if let Err(e) = std::fs::write(&path, input) {
                eprintln!("error: writing {}: {e}", path.display());
                std::process::exit(1);
            }
        }
        println!(
            "{:<16} {:>3} seeds in {}",
            t.name,
            inputs.len(),
            dir.display()
        );
    }
}
