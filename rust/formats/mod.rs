//! Profiles as bytes: our own file and wire forms, speedscope, pprof, flame graphs
//! and diffs, with the compression and size limits they share.

pub mod compress;
pub mod diff;
pub mod files;
pub mod flamegraph;
pub mod limits;
pub mod memory;
pub mod pprof;
pub mod speedscope;
pub mod speedscope_read;
pub mod wire;
pub mod wire_columns;
