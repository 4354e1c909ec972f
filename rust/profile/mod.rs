//! The profile model and what is computed from it: grouped views, summaries,
//! span selections and timelines.

pub mod build;
pub mod intern;
pub mod model;
pub mod resources;
pub mod sample;
pub mod spans;
pub mod spread;
pub mod stalls;
pub mod summary;
pub mod timeline;
pub mod views;
