#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bertkit_fuzz_targets::model_json(data));
