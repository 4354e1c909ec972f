//! The errors that reach Python, each kind mapped to one exception type here.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::PyErr;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An option, argument or file the caller gave that cannot be used.
    #[error("{0}")]
    BadInput(String),
    /// Bytes that are not a profile another process sent.
    #[error("not a dask-pyspy profile: {0}")]
    NotAProfile(String),
    /// What the sampler cannot do in its state, or in this process.
    #[error("{0}")]
    Broken(String),
    /// A panic: a bug of ours.
    #[error("dask-pyspy failed (a bug, please report it): {0}")]
    Bug(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        match e {
            Error::BadInput(_) | Error::NotAProfile(_) => PyValueError::new_err(e.to_string()),
            Error::Broken(_) | Error::Bug(_) => PyRuntimeError::new_err(e.to_string()),
        }
    }
}
