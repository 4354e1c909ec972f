//! The profile model and what is computed from it: grouped views, summaries and
//! span selections.

pub mod build;
pub mod intern;
pub mod model;
pub mod spans;
pub mod summary;
pub mod views;
