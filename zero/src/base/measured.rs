//! What a job measured at join (the facts the plan decides from): its
//! links and quantization speed, and each route's collectives timed. The
//! probe (`crate::probe`) measures them; `crate::plan::resolve` reads them.

use serde::{Deserialize, Serialize};

/// One hop as the collectives see it: what each rank receives per second
/// while every rank of its group sends at once, and the time of an empty
/// exchange.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    pub bytes_per_s: f64,
    pub latency_s: f64,
}

/// The job's links and quantization speed, agreed by every rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Links {
    /// Inside a node (none with one rank per node).
    pub node: Option<Link>,
    /// Across nodes, each local rank to its peers on the other nodes, all
    /// local ranks at once (none on one node).
    pub cross: Option<Link>,
    /// Values per second this rank quantizes (f32 to int8 blocks).
    pub quantize_per_s: f64,
    /// Values per second it dequantizes.
    pub dequantize_per_s: f64,
    /// How long the probe took on this rank.
    pub seconds: f64,
}

/// What the job measured at join: its links, and the two collectives
/// timed by each route. What `mode="zeropp"` resolves its switches by.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    pub links: Links,
    pub routes: Routes,
}

/// The two collectives timed on this job by each route, with the code
/// that runs them in training (ZeRO-3's rings, qwZ, qgZ without error
/// feedback) on a unit of `values` parameters: seconds per call, the
/// slowest rank's.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Routes {
    pub values: usize,
    pub gather_plain: f64,
    pub gather_qwz: f64,
    pub reduce_plain: f64,
    pub reduce_qgz: f64,
    /// How long timing the routes took (the slowest rank).
    #[serde(default)]
    pub seconds: f64,
}
