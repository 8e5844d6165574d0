//! `zeropp plan`: its command line and what it prints (the model itself
//! is [`zeropp_zero::cost`], fed by [`crate::planner`]).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

#[derive(clap::Args, Clone, Debug)]
pub struct PlanArgs {
    /// Parameters of the model (default: the run's with --compute-from, so
    /// its compute and its size are one model's; else the built-in model,
    /// padded for 4 ranks: 138240).
    #[arg(long)]
    pub params: Option<f64>,
    /// Nodes (hosts, or groups of ranks behind one NIC) of the job.
    #[arg(long, default_value_t = 2)]
    pub nodes: usize,
    /// Ranks (GPUs) per node.
    #[arg(long, default_value_t = 2)]
    pub ranks_per_node: usize,
    /// Bandwidth one rank sees inside a node, GB/s (NVLink, PCIe, memory).
    #[arg(long, default_value_t = 1.0)]
    pub intra_gbps: f64,
    /// One NIC's achievable bandwidth, Gbit/s: what TCP gets through it
    /// (iperf3, or `bench-cluster/run.sh --probe` on the emulated cluster),
    /// not the port's nominal speed, of which frame and TCP headers and
    /// the flow's own behaviour take a share.
    #[arg(long, default_value_t = 1.0)]
    pub nic_gbit: f64,
    /// NICs per node, each of --nic-gbit.
    #[arg(long, default_value_t = 1)]
    pub nics_per_node: usize,
    /// Latency per message, microseconds.
    #[arg(long, default_value_t = 100.0)]
    pub alpha_us: f64,
    /// Seconds of compute per step (forward, recomputation, backward), as
    /// measured on a fast link; or --compute-from, or --tflops and
    /// --tokens-per-rank.
    #[arg(long)]
    pub compute_s: Option<f64>,
    /// Take the compute per step from a run's summary (`zeropp train
    /// --summary-json FILE`): its median compute (the step less its waits
    /// on communication), or, in summaries from before it was recorded,
    /// the median step of a ZeRO-3 run on a fast link. With --measured and
    /// no compute given: that run's own.
    #[arg(long, value_name = "SUMMARY_JSON")]
    pub compute_from: Option<PathBuf>,
    /// Sustained TFLOP/s per rank (compute = 8 x params x tokens / rate).
    #[arg(long)]
    pub tflops: Option<f64>,
    /// Tokens per rank per step.
    #[arg(long, default_value_t = 512.0)]
    pub tokens_per_rank: f64,
    /// Quantization kernels' throughput, GB/s of fp32 (a GPU: hundreds).
    /// Default: measured on this CPU (zeropp-quant, one thread, ~0.1 s).
    #[arg(long)]
    pub quant_gbps: Option<f64>,
    /// Units the model is gathered in.
    #[arg(long, default_value_t = 4)]
    pub units: usize,
    /// Values per block of qwZ's quantized weights (--block of zeropp
    /// train).
    #[arg(long, default_value_t = 256.0)]
    pub block: f64,
    /// Values per block of qgZ's quantized gradient hop inside the node.
    #[arg(long, default_value_t = 32.0)]
    pub qgz_block: f64,
    /// Bits of qgZ's first hop, inside the node, 16 for bf16 (zeropp
    /// train's default on GPU nodes much faster inside than across: 8; on
    /// nodes without GPUs: 16).
    #[arg(long, default_value_t = 8)]
    pub qgz_intra_bits: u32,
    /// Values per block of qgZ's hop across nodes in zeropp's default.
    #[arg(long, default_value_t = 64.0)]
    pub qgz_inter_block: f64,
    /// Forward gathers between refreshes of the qwZ references.
    #[arg(long, default_value_t = 100.0)]
    pub qwz_refresh: f64,
    /// Fraction of the hideable communication that overlaps compute: 1 =
    /// perfect prefetch (zeropp), 0 = none; systems whose gathers stall
    /// compute sit in between.
    #[arg(long, default_value_t = 1.0)]
    pub overlap: f64,
    /// Plan from what a run measured: its summary (`zeropp train
    /// --summary-json`, on the real hosts) gives the links and quantization
    /// speed timed at join, the layout, the model size and the switches it
    /// ran with (replacing --params, --nodes, --ranks-per-node,
    /// --intra-gbps, --nic-gbit, --quant-gbps and the formats); the plan
    /// then also prints that run's predicted step beside its measured one.
    #[arg(long, value_name = "SUMMARY_JSON")]
    pub measured: Option<PathBuf>,
    /// Also predict islands (`zeropp train --islands N`): N islands of
    /// whole nodes, each training on its own, an outer exchange of the
    /// whole model across them every H steps (--sync-every).
    #[arg(long)]
    pub islands: Option<usize>,
    /// The H values the islands table compares.
    #[arg(long, value_delimiter = ',', default_value = "10,20,50,100")]
    pub sync_every: Vec<usize>,
    /// Streamed islands: the fragments the model's outer exchange is cut
    /// into, each exchanged at its own step.
    #[arg(long, default_value_t = 1)]
    pub outer_fragments: usize,
    /// Streamed islands: the inner steps each exchange may run behind (0:
    /// waited for).
    #[arg(long, default_value_t = 0)]
    pub outer_delay: usize,
    /// Print the predictions as JSON (with --islands, an object that also
    /// holds the islands' table).
    #[arg(long)]
    pub json: bool,
}

/// Runs `zeropp plan` with `a`.
pub fn run(a: &PlanArgs) -> Result<()> {
    let params = params_of(a)?;
    let a = &PlanArgs {
        params: Some(params),
        ..a.clone()
    };
    check(a, params)?;
    let compute_s = compute_per_step(a, params)?;
    let quant_gbps = quantize_speed(a)?;
    let input = zeropp_zero::cost::PlanInput {
        params,
        nodes: a.nodes,
        ranks_per_node: a.ranks_per_node,
        intra_gbps: a.intra_gbps,
        nic_gbit: a.nic_gbit,
        nics_per_node: a.nics_per_node.max(1),
        alpha_s: a.alpha_us * 1e-6,
        compute_s,
        quant_gbps,
        units: a.units,
        block: a.block,
        qgz_block: a.qgz_block,
        qgz_intra_bits: a.qgz_intra_bits,
        qgz_inter_block: a.qgz_inter_block,
        qwz_refresh: a.qwz_refresh,
        overlap: a.overlap,
    };
    let run = match &a.measured {
        None => None,
        Some(path) => Some(measured_run(path, &input)?),
    };
    let input = run.as_ref().map_or(input, |r| r.input.clone());
    let this_run = run.as_ref().map(|r| {
        let p = input.predict(r.config);
        serde_json::json!({
            "config": r.config,
            "predicted_step_s": p.step_s,
            "measured_step_s": r.measured_step_s,
            "error": r.measured_step_s.map(|m| (p.step_s - m) / m),
            "prediction": p,
        })
    });
    let islands = match a.islands {
        None | Some(1) => None,
        Some(n) => Some(
            a.sync_every
                .iter()
                .map(|&h| input.predict_islands(n, h, a.outer_fragments, a.outer_delay))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| anyhow::anyhow!("--islands: {e}"))?,
        ),
    };
    if a.json {
        print_json(&input, this_run, islands)
    } else {
        let tokens = a.tokens_per_rank * input.world() as f64;
        print!("{}", zeropp_zero::cost::render(&input, tokens));
        if let Some(r) = this_run {
            println!("{}", zeropp_zero::cost::render_run(&r));
        }
        if let Some(isl) = &islands {
            print!("{}", zeropp_zero::cost::render_islands(&input, isl));
        }
        Ok(())
    }
}

/// The plan's inputs are ones a run could have: what is not is refused
/// naming the flag, never predicted as NaN.
fn check(a: &PlanArgs, params: f64) -> Result<()> {
    let positive = |v: f64| v.is_finite() && v > 0.0;
    for (flag, v) in [
        ("--params", params),
        ("--intra-gbps", a.intra_gbps),
        ("--nic-gbit", a.nic_gbit),
        ("--tokens-per-rank", a.tokens_per_rank),
        ("--qwz-refresh", a.qwz_refresh),
    ] {
        if !positive(v) {
            bail!("{flag} {v}: must be a positive number");
        }
    }
    // Past any model (10^15 parameters, 4 PB of f32 weights): a mistyped
    // exponent, whose plan would print 10^21-second steps.
    if params > 1e15 {
        bail!("--params {params:e}: at most 1e15 parameters (7e9 is a 7B model)");
    }
    for (flag, v) in [
        ("--nodes", a.nodes),
        ("--ranks-per-node", a.ranks_per_node),
        ("--nics-per-node", a.nics_per_node),
        ("--units", a.units),
        ("--outer-fragments", a.outer_fragments),
    ] {
        if v == 0 {
            bail!("{flag} 0: must be at least 1");
        }
    }
    if !(a.alpha_us.is_finite() && a.alpha_us >= 0.0) {
        bail!(
            "--alpha-us {}: a latency of at least 0 microseconds",
            a.alpha_us
        );
    }
    if !(0.0..=1.0).contains(&a.overlap) {
        bail!("--overlap is a fraction from 0 (no overlap) to 1 (perfect prefetch)");
    }
    let whole = |flag: &str, v: f64| -> Result<usize> {
        if !(v.is_finite() && v >= 1.0 && v.fract() == 0.0) {
            bail!("{flag} {v}: a block of a whole number of values (a power of two such as 256)");
        }
        Ok(v as usize)
    };
    zeropp_quant::QuantFormat::int8(whole("--block", a.block)?)
        .map_err(|e| anyhow::anyhow!("--block: {e}"))?;
    let (qgz_block, inter) = (
        whole("--qgz-block", a.qgz_block)?,
        whole("--qgz-inter-block", a.qgz_inter_block)?,
    );
    zeropp_zero::plan::gradient_formats(a.qgz_intra_bits, qgz_block, Some(inter))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if a.sync_every.contains(&0) {
        bail!("--sync-every 0: an outer sync every H >= 1 steps");
    }
    if let Some(h) = a.sync_every.iter().find(|&&h| h <= a.outer_delay) {
        bail!(
            "--outer-delay {} with --sync-every {h}: an exchange lands before the next one \
             starts (a delay below every H)",
            a.outer_delay
        );
    }
    Ok(())
}

/// The compute per step the plan is for: given, read from a run's
/// summary, or estimated from the model's FLOPs and the device's TFLOP/s.
fn compute_per_step(a: &PlanArgs, params: f64) -> Result<f64> {
    let compute_s = match (a.compute_s, &a.compute_from, a.tflops) {
        (Some(_), Some(_), _) => bail!("give --compute-s or --compute-from, not both"),
        (Some(_), None, Some(_)) | (None, Some(_), Some(_)) => {
            bail!(
                "--tflops estimates the compute that --compute-s or --compute-from gives: give one"
            )
        }
        (Some(c), None, None) => c,
        (None, Some(path), None) => compute_from_summary(path)?,
        (None, None, Some(t)) if t > 0.0 && t.is_finite() => {
            8.0 * params * a.tokens_per_rank / (t * 1e12)
        }
        (None, None, Some(t)) => bail!("--tflops {t}: a positive rate (TFLOP/s per rank)"),
        // The measured run's own compute.
        (None, None, None) if a.measured.is_some() => {
            compute_from_summary(a.measured.as_deref().expect("checked"))?
        }
        _ => bail!(
            "give the compute per step: --compute-s S, --compute-from SUMMARY_JSON, or --tflops T (with --tokens-per-rank)"
        ),
    };
    if !(compute_s.is_finite() && compute_s >= 0.0) {
        bail!("the compute per step must be a non-negative number of seconds, not {compute_s}");
    }
    Ok(compute_s)
}

/// The quantizer's speed: given, the measured run's own, or measured on
/// this CPU now.
fn quantize_speed(a: &PlanArgs) -> Result<f64> {
    match a.quant_gbps {
        Some(q) if q > 0.0 && q.is_finite() => Ok(q),
        Some(q) => bail!("--quant-gbps must be a positive number of GB/s, not {q}"),
        // The run's own figure replaces it.
        None if a.measured.is_some() => Ok(1.0),
        None => {
            let q = crate::planner::measure_quant_gbps()?;
            if !a.json {
                println!(
                    "quantization: {q:.2} GB/s of f32 measured on this CPU (one thread; give --quant-gbps for GPU kernels)"
                );
            }
            Ok(q)
        }
    }
}

/// The run a `--measured` summary describes, as the plan's input.
fn measured_run(
    path: &std::path::Path,
    input: &zeropp_zero::cost::PlanInput,
) -> Result<crate::planner::FromRun> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the run summary {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    crate::planner::from_run(&v, input).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// `--json`: the predictions, with the measured run and the islands' when
/// asked for.
fn print_json(
    input: &zeropp_zero::cost::PlanInput,
    this_run: Option<serde_json::Value>,
    islands: Option<Vec<zeropp_zero::cost::IslandsPrediction>>,
) -> Result<()> {
    let preds = input.compare();
    let out = match (islands, this_run) {
        (Some(isl), run) => serde_json::json!({
            "input": input, "predictions": preds, "islands": isl, "run": run,
        }),
        (None, None) => serde_json::to_value(&preds)?,
        (None, Some(r)) => serde_json::json!({ "run": r, "input": input, "predictions": preds }),
    };
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// A `zeropp train --summary-json` file's JSON.
fn read_summary(path: &std::path::Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the run summary {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not a run summary (JSON written by `zeropp train --summary-json`)",
            path.display()
        )
    })
}

/// The model's parameters: `--params`, else the `--compute-from` run's
/// (its compute is that model's; said in a note), else the built-in
/// model's.
fn params_of(a: &PlanArgs) -> Result<f64> {
    if let Some(p) = a.params {
        return Ok(p);
    }
    if let Some(path) = &a.compute_from {
        let v = read_summary(path)?;
        if let Some(p) = v
            .get("params")
            .and_then(|p| p.as_f64())
            .filter(|p| *p > 0.0)
        {
            if !a.json {
                println!("model: {p} parameters, the run's of {}", path.display());
            }
            return Ok(p);
        }
    }
    Ok(138_240.0)
}

/// The compute per step of a `zeropp train --summary-json` file: its
/// median compute, or, in summaries from before it was recorded, its
/// median step (the compute when that run was ZeRO-3 on a fast link).
fn compute_from_summary(path: &std::path::Path) -> Result<f64> {
    let v = read_summary(path)?;
    // The run's own work per step (its step less its waits on
    // communication), where the summary has it.
    if let Some(c) = v
        .get("median_compute_s")
        .and_then(|x| x.as_f64())
        .filter(|c| *c > 0.0)
    {
        return Ok(c);
    }
    let Some(step) = v.get("median_step_time_s").and_then(|x| x.as_f64()) else {
        bail!(
            "{} has no median_step_time_s: give the JSON `zeropp train --summary-json` writes",
            path.display()
        );
    };
    if v.get("mode").and_then(|m| m.as_str()) != Some("zero3") {
        eprintln!(
            "note: {} is not a ZeRO-3 run; its step includes ZeRO++'s quantization, which the plan adds again",
            path.display()
        );
    }
    Ok(step)
}
