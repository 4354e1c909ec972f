//! Option names as Python spells them, shared by every table of names.

use crate::error::{Error, Result};

/// The value named `s` in `names`, or an error naming the option `what` and every
/// allowed name, as `options.py` words it.
pub fn choose<T: Copy>(what: &str, s: &str, names: &[(&str, T)]) -> Result<T> {
    names.iter().find(|(name, _)| *name == s).map(|&(_, value)| value).ok_or_else(|| {
        let allowed: Vec<String> = names.iter().map(|(name, _)| format!("'{name}'")).collect();
        Error::BadInput(format!("{what} must be one of {}, got {s:?}", allowed.join(", ")))
    })
}
