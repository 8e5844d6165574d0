//! `zeropp plan --measured`: the cost model ([`crate::cost`])
//! fed by what a run measured at join ([`from_run`]), and this CPU's
//! quantization throughput ([`measure_quant_gbps`]).

use crate::cost::{Config, PlanInput};

/// What `zeropp plan --measured` takes from a run's summary (`zeropp
/// train --summary-json`): the links and quantization speed the job
/// measured at join, its layout and size, and the switches it ran with.
#[derive(Clone, Debug, PartialEq)]
pub struct FromRun {
    /// `base` with the run's layout, links, quantization and formats.
    pub input: PlanInput,
    /// The switches the run resolved, as a configuration.
    pub config: Config,
    /// The run's median step, seconds.
    pub measured_step_s: Option<f64>,
}

/// Why a run's summary gives no plan: what is missing or malformed, and
/// what to give instead.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("the summary has no {0:?}: give the JSON `zeropp train --summary-json` writes")]
    Missing(String),
    #[error(
        "the summary has no \"measured\" links: the run measured nothing at join (logical \
         nodes, one rank, or ZEROPP_PROBE=0); run on the real hosts, or give --nic-gbit and \
         --intra-gbps"
    )]
    NotMeasured,
    #[error("the summary's {field:?} is not what zeropp writes: {source}")]
    Malformed {
        field: &'static str,
        source: serde_json::Error,
    },
    #[error("the summary's {0:?} is not a positive number")]
    NotPositive(String),
}

/// Reads a run summary into the plan of that run (`base` gives what the
/// summary does not: compute, units, overlap). Errors say what is missing.
pub fn from_run(summary: &serde_json::Value, base: &PlanInput) -> Result<FromRun, RunError> {
    use crate::measured::Measured;
    use crate::plan::Switches;
    let field = |k: &str| {
        summary
            .get(k)
            .filter(|v| !v.is_null())
            .ok_or_else(|| RunError::Missing(k.to_string()))
    };
    let malformed = |field| move |source| RunError::Malformed { field, source };
    let measured = field("measured").map_err(|_| RunError::NotMeasured)?;
    let measured: Measured =
        serde_json::from_value(measured.clone()).map_err(malformed("measured"))?;
    let switches: Switches =
        serde_json::from_value(field("switches")?.clone()).map_err(malformed("switches"))?;
    let count = |k: &str| {
        field(k)?
            .as_f64()
            .filter(|v| *v >= 1.0)
            .ok_or_else(|| RunError::NotPositive(k.to_string()))
    };
    let (world, nodes, params) = (count("world_size")?, count("nodes")?, count("params")?);
    let g = (world / nodes).round().max(1.0) as usize;
    let input = input_from(&measured, &switches, nodes as usize, g, params, base);
    let config = Config {
        name: "this run",
        weight_bits: switches.qwz_bits.unwrap_or(16),
        hpz: switches.hpz,
        qgz: switches.qgz,
        beyond: switches.qwz_delta,
    };
    Ok(FromRun {
        input,
        config,
        measured_step_s: summary.get("median_step_time_s").and_then(|v| v.as_f64()),
    })
}

/// The cost model's input for a job of `nodes` × `g` ranks and `params`
/// parameters from the links and quantization speed it measured at join
/// and the switches it runs with; `base` gives the rest (compute, units,
/// overlap) and any figure the measurement lacks.
pub fn input_from(
    measured: &crate::measured::Measured,
    switches: &crate::plan::Switches,
    nodes: usize,
    g: usize,
    params: f64,
    base: &PlanInput,
) -> PlanInput {
    let (gf, nf) = (g as f64, nodes as f64);
    let l = &measured.links;
    let (node, cross) = (l.node, l.cross);
    // The probe's rates are per rank while every rank of the hop sends at
    // once: a node's ranks share its NIC across.
    let nic_gbit = cross.map_or(base.nic_gbit, |c| nic_gbit(c, g));
    let intra_gbps = node.map_or(base.intra_gbps, |n| n.bytes_per_s / 1e9);
    let alpha_s = [
        node.map(|n| n.latency_s / (gf - 1.0).max(1.0)),
        cross.map(|c| c.latency_s / (nf - 1.0).max(1.0)),
    ]
    .into_iter()
    .flatten()
    .fold(0.0, f64::max);
    let quant_gbps = 8.0 / (1.0 / l.quantize_per_s + 1.0 / l.dequantize_per_s) / 1e9;
    PlanInput {
        params,
        nodes,
        ranks_per_node: g,
        intra_gbps,
        nic_gbit,
        nics_per_node: 1,
        alpha_s: if alpha_s > 0.0 { alpha_s } else { base.alpha_s },
        quant_gbps: if quant_gbps.is_finite() && quant_gbps > 0.0 {
            quant_gbps
        } else {
            base.quant_gbps
        },
        block: switches.block as f64,
        qgz_block: switches.qgz_block as f64,
        qgz_intra_bits: switches.qgz_intra_bits,
        qgz_inter_block: switches.qgz_inter_block.unwrap_or(switches.qgz_block) as f64,
        qwz_refresh: switches.qwz_refresh as f64,
        ..base.clone()
    }
}

/// A node's NIC rate, Gbit/s, from a link the probe measured per rank
/// while the node's `g` ranks sent at once.
pub fn nic_gbit(link: crate::measured::Link, g: usize) -> f64 {
    link.bytes_per_s * g as f64 * 8.0 / 1e9
}

/// The quantization kernels' throughput on this CPU (zeropp-quant, one
/// thread), GB/s of f32 processed: an int8 quantize and a dequantize of
/// 4M values in 256-value blocks, best of three each, combined as the
/// engine spends them (one of each per value on the path).
pub fn measure_quant_gbps() -> Result<f64, zeropp_quant::QuantError> {
    use std::time::Instant;
    use zeropp_quant::{QuantFormat, QuantizedTensor, Rounding};
    let n = 4 << 20;
    let values: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 2003) as f32 * 1e-3 - 1.0)
        .collect();
    let format = QuantFormat::int8(256)?;
    let mut q = QuantizedTensor::zeroed(format, n);
    let mut out = vec![0f32; n];
    let (mut quant_s, mut dequant_s) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..3 {
        let t = Instant::now();
        zeropp_quant::kernels::quantize(&values, Rounding::NearestEven, q.as_mut())?;
        quant_s = quant_s.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        zeropp_quant::kernels::dequantize(q.as_ref(), &mut out)?;
        dequant_s = dequant_s.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * n as f64 * 4.0 / (quant_s + dequant_s) / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::config;

    /// A summary as `zeropp train --summary-json` writes it on 2 hosts x 2
    /// ranks with the links measured at join.
    fn run_summary() -> serde_json::Value {
        serde_json::json!({
            "mode": "zeropp", "world_size": 4, "nodes": 2, "params": 3_758_592,
            "median_step_time_s": 0.9,
            "switches": crate::plan::Switches::zeropp(256),
            "measured": {
                "links": {
                    "node": {"bytes_per_s": 2.0e9, "latency_s": 50e-6},
                    "cross": {"bytes_per_s": 1.5e6, "latency_s": 400e-6},
                    "quantize_per_s": 4.0e8, "dequantize_per_s": 1.0e9, "seconds": 0.3
                },
                "routes": {"values": 1 << 20, "gather_plain": 0.1, "gather_qwz": 0.05,
                           "reduce_plain": 0.1, "reduce_qgz": 0.04}
            }
        })
    }

    #[test]
    fn a_run_summary_gives_its_links_layout_and_switches() {
        let base = PlanInput::emulated_cluster(1.0);
        let r = from_run(&run_summary(), &base).unwrap();
        let i = &r.input;
        assert_eq!((i.nodes, i.ranks_per_node, i.params), (2, 2, 3_758_592.0));
        // Per-rank rates with both local ranks sending: the NIC carries 2x.
        assert!((i.nic_gbit - 1.5e6 * 2.0 * 8.0 / 1e9).abs() < 1e-12);
        assert!((i.intra_gbps - 2.0).abs() < 1e-12);
        assert!((i.alpha_s - 400e-6).abs() < 1e-12);
        // f32 processed by a quantize and a dequantize of each value.
        let q = 8.0 / (1.0 / 4.0e8 + 1.0 / 1.0e9) / 1e9;
        assert!((i.quant_gbps - q).abs() < 1e-12);
        assert_eq!((i.qgz_inter_block, i.qwz_refresh), (64.0, 100.0));
        assert_eq!(i.compute_s, base.compute_s);
        let c = r.config;
        assert_eq!(
            (c.weight_bits, c.hpz, c.qgz, c.beyond),
            (4, true, true, true)
        );
        assert_eq!(r.measured_step_s, Some(0.9));
        // Its prediction is the default configuration's on those links.
        let same = i.predict(config("zeropp")).step_s;
        assert_eq!(i.predict(c).step_s, same);
        // What is missing is named.
        let mut no_links = run_summary();
        no_links["measured"] = serde_json::Value::Null;
        let e = from_run(&no_links, &base).unwrap_err();
        assert!(matches!(e, RunError::NotMeasured), "{e:?}");
        assert!(e.to_string().contains("measured nothing at join"), "{e}");
        let mut no_world = run_summary();
        no_world.as_object_mut().unwrap().remove("world_size");
        let e = from_run(&no_world, &base).unwrap_err();
        assert!(e.to_string().contains("\"world_size\""), "{e}");
    }
}
