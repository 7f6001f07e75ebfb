//! [`Switch`]: a process-wide setting that the environment decides until code sets it (the
//! CUDA kernels' and the optimiser's forms, turned on by default only once they have passed
//! their check on a GPU).

use std::sync::atomic::{AtomicU8, Ordering};

/// An on/off setting for the process: unset, the environment settles it on first use
/// ([`Switch::opt_in`]: off unless a variable says on; [`Switch::opt_out`]: on unless it says
/// off); [`Switch::set`] overrides it.
#[derive(Debug)]
pub struct Switch {
    /// 0 unset, 1 off, 2 on.
    state: AtomicU8,
    /// The environment variable that decides it, and its value that turns the default over.
    variable: &'static str,
    value: &'static str,
    /// Whether the switch is on when the variable does not say `value`.
    default: bool,
}

impl Switch {
    /// A switch that is off unless the environment variable `variable` is `value`.
    pub const fn opt_in(variable: &'static str, value: &'static str) -> Self {
        Switch {
            state: AtomicU8::new(0),
            variable,
            value,
            default: false,
        }
    }

    /// A switch that is on unless the environment variable `variable` is `value`.
    pub const fn opt_out(variable: &'static str, value: &'static str) -> Self {
        Switch {
            default: true,
            ..Switch::opt_in(variable, value)
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
                let on = self.default != env_is(self.variable, self.value);
                self.set(on);
                on
            }
            setting => setting == 2,
        }
    }

    /// For a switch off by default, the environment setting that turns it on: `VARIABLE=value`.
    pub fn turned_on_by(&self) -> Option<String> {
        (!self.default).then(|| format!("{}={}", self.variable, self.value))
    }
}

/// Whether the environment variable `name` is set to `value`.
pub fn env_is(name: &str, value: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == value)
}

#[cfg(test)]
mod tests {
    use super::*;

    static ON_UNTIL_SET: Switch = Switch::opt_out("BERTKIT_NO_SUCH_VARIABLE", "off");
    static OFF_UNTIL_SET: Switch = Switch::opt_in("BERTKIT_NO_SUCH_VARIABLE", "on");

    #[test]
    fn a_switch_is_decided_once_then_set() {
        assert!(ON_UNTIL_SET.get());
        ON_UNTIL_SET.set(false);
        assert!(!ON_UNTIL_SET.get());
        assert!(!OFF_UNTIL_SET.get());
        OFF_UNTIL_SET.set(true);
        assert!(OFF_UNTIL_SET.get());
        assert!(!env_is("BERTKIT_NO_SUCH_VARIABLE", "x"));
        assert_eq!(ON_UNTIL_SET.turned_on_by(), None);
        assert_eq!(
            OFF_UNTIL_SET.turned_on_by().as_deref(),
            Some("BERTKIT_NO_SUCH_VARIABLE=on")
        );
    }
}
