//! [`Switch`]: a process-wide setting that the environment decides until code sets it (the
//! CUDA kernels' and the optimiser's forms, turned on by default only once they have passed
//! their check on a GPU).

use std::sync::atomic::{AtomicU8, Ordering};

/// An on/off setting for the process: unset, the environment settles it on first use
/// ([`Switch::opt_in`]: off unless a variable says on; [`Switch::opt_out`]: on unless it says
/// off); [`Switch::set`] overrides it. [`Switch::chosen`] tells a setting someone chose (the
/// environment or code) from the default, for a caller that may choose better (the trainer's
/// memory plan).
#[derive(Debug)]
pub struct Switch {
    /// 0 unsettled; chosen (set, or its variable in the environment): 1 off, 2 on; the
    /// default: 3 off, 4 on.
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
                let (on, chosen) = match self.environment_setting() {
                    Some(on) => (on, true),
                    None => (self.default, false),
                };
                let state = match (chosen, on) {
                    (true, false) => 1,
                    (true, true) => 2,
                    (false, false) => 3,
                    (false, true) => 4,
                };
                self.state.store(state, Ordering::Relaxed);
                on
            }
            state => state == 2 || state == 4,
        }
    }

    /// The setting someone chose: [`Switch::set`]'s, else the environment's (its variable set
    /// to anything: `value` turns the default over, another value keeps it); `None` while the
    /// default stands unchosen.
    pub fn chosen(&self) -> Option<bool> {
        match self.state.load(Ordering::Relaxed) {
            1 => Some(false),
            2 => Some(true),
            0 => self.environment_setting(),
            _ => None,
        }
    }

    /// The environment's setting: `None` when its variable is unset or empty.
    fn environment_setting(&self) -> Option<bool> {
        let value = std::env::var(self.variable)
            .ok()
            .filter(|v| !v.is_empty())?;
        Some(self.default != (value == self.value))
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
    static SETTLED_BY_DEFAULT: Switch = Switch::opt_out("BERTKIT_NO_SUCH_VARIABLE_EITHER", "off");

    #[test]
    fn a_switch_is_decided_once_then_set() {
        assert!(ON_UNTIL_SET.get());
        ON_UNTIL_SET.set(false);
        assert!(!ON_UNTIL_SET.get());
        assert!(!OFF_UNTIL_SET.get());
        OFF_UNTIL_SET.set(true);
        assert!(OFF_UNTIL_SET.get());
        assert!(!env_is("BERTKIT_NO_SUCH_VARIABLE", "x"));
        assert_eq!(ON_UNTIL_SET.chosen(), Some(false));
        assert_eq!(OFF_UNTIL_SET.chosen(), Some(true));
    }

    /// A default read is not a choice; a setting made afterwards is.
    #[test]
    fn the_default_is_not_a_choice() {
        assert_eq!(SETTLED_BY_DEFAULT.chosen(), None);
        assert!(SETTLED_BY_DEFAULT.get());
        assert_eq!(SETTLED_BY_DEFAULT.chosen(), None);
        assert!(SETTLED_BY_DEFAULT.get());
        SETTLED_BY_DEFAULT.set(true);
        assert_eq!(SETTLED_BY_DEFAULT.chosen(), Some(true));
        assert!(SETTLED_BY_DEFAULT.get());
    }
}
