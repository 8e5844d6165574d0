//! `zeropp._zeropp`: the Rust side of the `zeropp` Python package. It calls
//! the library directly — the ZeRO++ collectives of `zeropp-zero`, the
//! transports of `zeropp-comm`, the quantizers of `zeropp-quant`, the
//! topology of `zeropp-topology` — over host buffers passed without copies.
//! The Python package (`python/zeropp/`) does argument checking and torch
//! glue only.

mod buffers;
mod calls;
mod collectives;
mod cuda;
mod device;
mod emulated;
mod outer;
mod quant;
mod state;

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

create_exception!(
    _zeropp,
    ZeroppError,
    PyRuntimeError,
    "A zeropp operation failed; the message says why and what to do."
);
create_exception!(
    _zeropp,
    PeerError,
    ZeroppError,
    "Another rank died, hung or became unreachable; the message names it."
);

/// What the bindings raise, told apart as Python callers tell them apart:
/// another rank's failure (`PeerError`: the job cannot go on) or this
/// rank's (`ZeroppError`: the message says what to change).
pub(crate) trait Failure: std::fmt::Display {
    fn is_peer_failure(&self) -> bool;
}

impl Failure for zeropp_comm::CommError {
    fn is_peer_failure(&self) -> bool {
        zeropp_comm::CommError::is_peer_failure(self)
    }
}

impl Failure for zeropp_zero::ZeroError {
    fn is_peer_failure(&self) -> bool {
        zeropp_zero::ZeroError::is_peer_failure(self)
    }
}

impl Failure for zeropp_zero::plan::PlanError {
    fn is_peer_failure(&self) -> bool {
        false
    }
}

impl Failure for zeropp_zero::layout::LayoutError {
    fn is_peer_failure(&self) -> bool {
        false
    }
}

impl Failure for zeropp_cuda::CudaError {
    fn is_peer_failure(&self) -> bool {
        zeropp_cuda::CudaError::is_peer_failure(self)
    }
}

/// A failure the bindings describe themselves: a check of their own, or
/// an outcome kept until `wait`.
#[derive(Clone, Debug)]
pub(crate) struct Raised {
    pub peer: bool,
    pub message: String,
}

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl Failure for Raised {
    fn is_peer_failure(&self) -> bool {
        self.peer
    }
}

/// The one conversion of a failure into the Python exception that fits it.
pub(crate) fn to_py(e: impl Failure) -> PyErr {
    if e.is_peer_failure() {
        PeerError::new_err(e.to_string())
    } else {
        ZeroppError::new_err(e.to_string())
    }
}

/// This rank's failure, described by the bindings.
pub(crate) fn invalid(msg: impl Into<String>) -> PyErr {
    to_py(Raised {
        peer: false,
        message: msg.into(),
    })
}

/// What `zeropp topo --json` reports of this machine (or of a captured
/// tree under `sysfs_root`), as JSON.
#[pyfunction]
#[pyo3(signature = (sysfs_root=None))]
fn topology_json(sysfs_root: Option<String>) -> PyResult<String> {
    let root = sysfs_root.unwrap_or_else(|| "/".into());
    let topo = zeropp_topology::detect::detect(std::path::Path::new(&root))
        .map_err(|e| invalid(format!("topology of {root}: {e}")))?;
    serde_json::to_string(&topo).map_err(|e| invalid(e.to_string()))
}

/// The routing plan for `nodes` nodes like this machine (or the captured
/// tree under `sysfs_root`), `ranks_per_node` ranks each, and the switches
/// a run resolves from it (`run_switches`), as JSON.
#[pyfunction]
#[pyo3(signature = (nodes, ranks_per_node, sysfs_root=None))]
fn routing_plan_json(
    nodes: usize,
    ranks_per_node: usize,
    sysfs_root: Option<String>,
) -> PyResult<String> {
    let root = sysfs_root.unwrap_or_else(|| "/".into());
    let topo = zeropp_topology::detect::detect(std::path::Path::new(&root))
        .map_err(|e| invalid(format!("topology of {root}: {e}")))?;
    let plan = zeropp_zero::routing::plan(&topo, nodes, ranks_per_node)
        .map_err(|e| invalid(e.to_string()))?;
    // As `zeropp topo plan --json`: the switches a run resolves from it.
    let run = zeropp_zero::plan::before_measuring(&topo, nodes, ranks_per_node)
        .map_err(|e| invalid(e.to_string()))?;
    let mut v = serde_json::to_value(&plan).map_err(|e| invalid(e.to_string()))?;
    v["run_switches"] = serde_json::to_value(&run).map_err(|e| invalid(e.to_string()))?;
    serde_json::to_string(&v).map_err(|e| invalid(e.to_string()))
}

/// The switches' names (`fully_shard`'s keywords, `zeropp train`'s
/// settings), from the library's own declaration.
#[pyfunction]
fn switch_names() -> Vec<String> {
    zeropp_zero::plan::Switches::NAMES
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// The seconds `value` says, as a network wait's limit (the library's one
/// rule, `zeropp_comm::env::wait_limit`); refused naming `name` otherwise.
#[pyfunction]
fn wait_limit(name: &str, value: &str) -> PyResult<f64> {
    value
        .trim()
        .parse::<f64>()
        .ok()
        .and_then(zeropp_comm::env::wait_limit)
        .map(|d| d.as_secs_f64())
        .ok_or_else(|| {
            invalid(format!(
                "{name}={value:?}: {}",
                zeropp_comm::env::WAIT_LIMIT
            ))
        })
}

/// `zeropp train`'s built-in corpus (simple English sentences from a small
/// grammar; bytes are tokens): `n` bytes for `seed`.
#[pyfunction]
fn builtin_corpus<'py>(py: Python<'py>, n: usize, seed: u64) -> Bound<'py, pyo3::types::PyBytes> {
    pyo3::types::PyBytes::new(py, &zeropp_corpus::builtin_corpus(n, seed))
}

/// The collectives' reused buffers in this process
/// (`zeropp_comm::scratch`): buffers taken, how many of them were reused
/// rather than allocated, and the bytes of free buffers held now.
#[pyfunction]
fn scratch_stats() -> std::collections::HashMap<&'static str, u64> {
    let s = zeropp_comm::scratch::stats();
    std::collections::HashMap::from([
        ("taken", s.taken),
        ("reused", s.reused),
        ("allocated", s.allocated()),
        ("held_bytes", zeropp_comm::scratch::held_bytes()),
    ])
}

#[pymodule]
fn _zeropp(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ZeroppError", m.py().get_type::<ZeroppError>())?;
    m.add("PeerError", m.py().get_type::<PeerError>())?;
    m.add_function(wrap_pyfunction!(topology_json, m)?)?;
    m.add_function(wrap_pyfunction!(routing_plan_json, m)?)?;
    m.add_function(wrap_pyfunction!(builtin_corpus, m)?)?;
    m.add_function(wrap_pyfunction!(switch_names, m)?)?;
    m.add_function(wrap_pyfunction!(scratch_stats, m)?)?;
    m.add_function(wrap_pyfunction!(wait_limit, m)?)?;
    quant::register(m)?;
    collectives::register(m)?;
    cuda::register(m)?;
    emulated::register(m)?;
    outer::register(m)?;
    Ok(())
}
