//! Plain values across the Python boundary: what Rust serialises arrives as dicts,
//! lists and scalars, and dicts from Python arrive as JSON values (as `json.dumps`
//! with `default=str` would have read them).

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{Map, Number, Value};

use crate::error::Error;

/// `value` as Python objects.
pub fn to_py<'py>(py: Python<'py>, value: &impl Serialize) -> PyResult<Bound<'py, PyAny>> {
    let value = serde_json::to_value(value).map_err(|e| Error::Bug(format!("a value that does not serialise: {e}")))?;
    value_to_py(py, &value)
}

fn value_to_py<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => i.into_pyobject(py)?.into_any(),
            (None, Some(u)) => u.into_pyobject(py)?.into_any(),
            _ => PyFloat::new(py, n.as_f64().unwrap_or(f64::NAN)).into_any(),
        },
        Value::String(s) => PyString::new(py, s).into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(value_to_py(py, item)?)?;
            }
            list.into_any()
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (key, item) in map {
                dict.set_item(key, value_to_py(py, item)?)?;
            }
            dict.into_any()
        }
    })
}

/// A Python dict as a JSON object.
pub fn object(dict: &Bound<'_, PyDict>) -> PyResult<Map<String, Value>> {
    let mut map = Map::new();
    for (key, item) in dict.iter() {
        map.insert(key_text(&key)?, from_py(&item)?);
    }
    Ok(map)
}

/// A Python dict as `T`, a ValueError naming `what` if it does not fit.
pub fn typed<T: DeserializeOwned>(dict: &Bound<'_, PyDict>, what: &str) -> PyResult<T> {
    let value = Value::Object(object(dict)?);
    Ok(serde_json::from_value(value).map_err(|e| Error::BadInput(format!("{what}: {e}")))?)
}

/// A key as `json.dumps` writes it.
fn key_text(key: &Bound<'_, PyAny>) -> PyResult<String> {
    Ok(match from_py(key)? {
        Value::String(s) => s,
        other => other.to_string(),
    })
}

/// Any other object becomes its `str()`, as `json.dumps(default=str)` makes it.
fn from_py(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    Ok(if obj.is_none() {
        Value::Null
    } else if let Ok(b) = obj.cast::<PyBool>() {
        Value::Bool(b.is_true())
    } else if obj.is_instance_of::<PyInt>() {
        match (obj.extract::<i64>(), obj.extract::<u64>()) {
            (Ok(i), _) => Value::from(i),
            (_, Ok(u)) => Value::from(u),
            _ => Value::String(obj.str()?.to_string_lossy().into_owned()),
        }
    } else if let Ok(f) = obj.cast::<PyFloat>() {
        Number::from_f64(f.value()).map_or(Value::Null, Value::Number)
    } else if let Ok(s) = obj.cast::<PyString>() {
        Value::String(s.to_string_lossy().into_owned())
    } else if let Ok(dict) = obj.cast::<PyDict>() {
        Value::Object(object(dict)?)
    } else if let Ok(list) = obj.cast::<PyList>() {
        Value::Array(list.iter().map(|i| from_py(&i)).collect::<PyResult<_>>()?)
    } else if let Ok(tuple) = obj.cast::<PyTuple>() {
        Value::Array(tuple.iter().map(|i| from_py(&i)).collect::<PyResult<_>>()?)
    } else {
        Value::String(obj.str()?.to_string_lossy().into_owned())
    })
}
