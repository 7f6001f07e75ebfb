//! [`Switch`]: a process-wide setting that the environment decides until code sets it (the
//! CUDA kernels' and the optimiser's forms, turned on by default only once they have passed
//! their check on a GPU).

use std::sync::atomic::{AtomicU8, Ordering};

/// An on/off setting for the process: unset, `decide` (reading the environment) settles it on
/// first use; [`Switch::set`] overrides it.
#[derive(Debug)]
pub struct Switch {
    /// 0 unset, 1 off, 2 on.
    state: AtomicU8,
    decide: fn() -> bool,
}

impl Switch {
    /// A switch that `decide` settles on first use.
    pub const fn new(decide: fn() -> bool) -> Self {
        Switch {
            state: AtomicU8::new(0),
            decide,
        }
    }

    /// Turns the switch on or off for the rest of the process.
    pub fn set(&self, on: bool) {
        self.state.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    }

    /// Whether the switch is on.
    pub fn get(&self) -> bool {
        match self.state.load(Ordering::Relaxed) {
            0 => {
                let on = (self.decide)();
                self.set(on);
                on
            }
            setting => setting == 2,
        }
    }
}

/// Whether the environment variable `name` is set to `value`.
pub fn env_is(name: &str, value: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == value)
}

#[cfg(test)]
mod tests {
    use super::*;

    static ON_UNTIL_SET: Switch = Switch::new(|| true);

    #[test]
    fn a_switch_is_decided_once_then_set() {
        assert!(ON_UNTIL_SET.get());
        ON_UNTIL_SET.set(false);
        assert!(!ON_UNTIL_SET.get());
        assert!(!env_is("BERTKIT_NO_SUCH_VARIABLE", "x"));
    }
}
