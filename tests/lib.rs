//! Cross-crate tests of bertkit's stage hand-offs live in `tests/tests/`: each checks that what
//! one stage writes (files + manifest) is exactly what the next stage is promised.
