//! Sampler options, read by attribute from Python's options object and checked once.

use crate::error::{Error, Result};
use crate::reader::{native, LineMode, ReaderChoice};
use crate::sampling::history::MAX_STEP_NS;
use crate::sampling::store::Retention;
use pyo3::prelude::*;
use serde::Serialize;

pub const MAX_RATE: f64 = 10_000.0;
pub const MIN_MEMORY: usize = 1 << 20;
pub const MAX_RECENT: f64 = 7.0 * 86_400.0;

#[derive(Clone, Debug, Serialize, FromPyObject)]
pub struct SamplerConfig {
    /// Samples per second requested.
    pub rate: f64,
    /// Keep samples of threads that are neither on a CPU nor holding the GIL.
    pub idle: bool,
    /// Only sample the thread holding the GIL.
    pub gil_only: bool,
    /// Largest fraction of one core the sampler may use.
    pub cpu_budget: f64,
    /// Cap on the sample store, bytes.
    pub max_memory: usize,
    /// Seconds samples stay raw; older ones are folded into the history.
    pub recent: f64,
    /// Seconds per history bucket.
    pub history_step: f64,
    /// Record the current line of each frame (off: function-level, ~25% cheaper).
    pub lines: bool,
    /// Aggregate by the first line of each function, like `py-spy record --function`.
    pub function: bool,
    /// Which stack reader to use (see `ReaderChoice`); `auto` prefers the fast one
    /// where its self-check passes. A name, so a wrong one is a ValueError of
    /// `validate`, not a TypeError of reading the options.
    pub reader: String,
    /// Also capture each running thread's native (C) frames, by a signal to it.
    pub native: bool,
    /// Also sample allocations, charged to the task running (`heap`).
    pub memory: bool,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            rate: 100.0,
            idle: false,
            gil_only: false,
            cpu_budget: 0.01,
            max_memory: 64 << 20,
            recent: 600.0,
            history_step: 60.0,
            lines: true,
            function: false,
            reader: "auto".into(),
            native: false,
            memory: false,
        }
    }
}

impl SamplerConfig {
    pub fn validate(&self) -> Result<()> {
        self.reader.parse::<ReaderChoice>()?;
        if let Some(why) = self.native.then(native::unsupported).flatten() {
            return Err(Error::BadInput(format!("native must be False here: {why}")));
        }
        if !(self.rate > 0.0 && self.rate <= MAX_RATE) {
            return Err(Error::BadInput(format!(
                "rate must be in (0, {MAX_RATE}] samples per second, got {}",
                self.rate
            )));
        }
        if !(self.cpu_budget > 0.0 && self.cpu_budget <= 1.0) {
            return Err(Error::BadInput(format!(
                "cpu_budget must be a fraction of one core in (0, 1], got {}",
                self.cpu_budget
            )));
        }
        if self.max_memory < MIN_MEMORY {
            return Err(Error::BadInput(format!(
                "max_memory must be at least {MIN_MEMORY} bytes (1 MiB), got {}",
                self.max_memory
            )));
        }
        if !(self.recent >= 0.0 && self.recent <= MAX_RECENT) {
            return Err(Error::BadInput(format!(
                "recent must be in [0, {MAX_RECENT}] seconds (a week), got {}",
                self.recent
            )));
        }
        if !(self.history_step >= 1.0 && self.history_step * 1e9 <= MAX_STEP_NS as f64) {
            return Err(Error::BadInput(format!(
                "history_step must be in [1, {}] seconds, got {}",
                MAX_STEP_NS / 1_000_000_000,
                self.history_step
            )));
        }
        Ok(())
    }

    /// How long samples stay raw and the step they fold into, in the store's terms.
    pub fn retention(&self) -> Retention {
        Retention { recent_ns: (self.recent * 1e9) as u64, step_ns: (self.history_step * 1e9) as u64 }
    }

    pub fn reader_choice(&self) -> ReaderChoice {
        self.reader.parse().expect("validated")
    }

    pub fn interval_secs(&self) -> f64 {
        1.0 / self.rate
    }

    pub fn line_mode(&self) -> LineMode {
        match (self.lines, self.function) {
            (_, true) => LineMode::First,
            (true, false) => LineMode::Current,
            (false, false) => LineMode::None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_out_of_range_options() {
        let bad = [
            SamplerConfig { rate: 0.0, ..Default::default() },
            SamplerConfig { rate: 10_001.0, ..Default::default() },
            SamplerConfig { rate: f64::NAN, ..Default::default() },
            SamplerConfig { cpu_budget: 0.0, ..Default::default() },
            SamplerConfig { cpu_budget: 1.5, ..Default::default() },
            SamplerConfig { max_memory: 1000, ..Default::default() },
            SamplerConfig { reader: "nope".into(), ..Default::default() },
            SamplerConfig { recent: -1.0, ..Default::default() },
            SamplerConfig { recent: f64::NAN, ..Default::default() },
            SamplerConfig { history_step: 0.5, ..Default::default() },
            SamplerConfig { history_step: 7200.0, ..Default::default() },
        ];
        let names = [
            "rate", "rate", "rate", "cpu_budget", "cpu_budget", "max_memory", "reader", "recent", "recent",
            "history_step", "history_step",
        ];
        for (cfg, name) in bad.iter().zip(names) {
            assert!(cfg.validate().unwrap_err().to_string().starts_with(name));
        }
        assert!(SamplerConfig::default().validate().is_ok());
    }

    #[test]
    fn line_modes() {
        assert_eq!(SamplerConfig::default().line_mode(), LineMode::Current);
        assert_eq!(SamplerConfig { lines: false, ..Default::default() }.line_mode(), LineMode::None);
        assert_eq!(SamplerConfig { function: true, ..Default::default() }.line_mode(), LineMode::First);
        let config = SamplerConfig { reader: "nope".into(), ..Default::default() };
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("reader must be one of 'auto', 'fast', 'pyspy'"));
    }
}
