//! Sampling: the thread that reads stacks on a clock, the thread states it draws,
//! and the store that keeps the samples until a window is exported.

pub mod backlog;
pub mod calls;
pub mod cap;
pub mod charge;
pub mod config;
pub mod cpu;
pub mod history;
pub mod lateness;
pub mod loops;
pub mod phases;
pub mod sampler;
pub mod series;
pub mod stalls;
pub mod states;
pub mod store;
pub mod thread;
pub mod watching;
pub mod window;
