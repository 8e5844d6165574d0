//! The cost model of `zeropp plan`, beside the plan whose switches it
//! prices (it moved here from zeropp-topology, which keeps the facts): one
//! training step (ring and hop formulas, each node's ranks sharing its
//! NICs, prefetch hiding the communication behind compute but one unit's
//! share) for ZeRO-3 and the ZeRO++ switch sets. A model size, N nodes × G
//! ranks, the links inside and across nodes, a compute time and the
//! quantization kernels' throughput give the step time per phase and a
//! recommendation. `zeropp_zero::planner` feeds it the links a run
//! measured at join.

use serde::Serialize;

/// What the plan is for.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlanInput {
    /// Parameters (Ψ).
    pub params: f64,
    pub nodes: usize,
    pub ranks_per_node: usize,
    /// Bandwidth one rank sees inside the node, GB/s.
    pub intra_gbps: f64,
    /// One NIC's bandwidth, Gbit/s, and NICs per node (shared by the
    /// node's ranks).
    pub nic_gbit: f64,
    pub nics_per_node: usize,
    /// Latency per message, seconds.
    pub alpha_s: f64,
    /// Seconds of forward + backward (with recomputation) per step.
    pub compute_s: f64,
    /// Quantization kernels' throughput, GB/s of fp32 processed.
    pub quant_gbps: f64,
    /// Units the model is gathered in: the first unit's gather (and the
    /// last unit's gradient) cannot hide behind compute.
    pub units: usize,
    /// Values per weight / gradient quantization block.
    pub block: f64,
    pub qgz_block: f64,
    /// Bits of qgZ's first hop, inside the node (the hop across is int4).
    pub qgz_intra_bits: u32,
    /// Values per block of qgZ's hop across nodes in zeropp's default
    /// (`beyond` configurations; the others use `qgz_block`).
    pub qgz_inter_block: f64,
    /// Forward gathers between refreshes of the qwZ references (weight
    /// differences).
    pub qwz_refresh: f64,
    /// How much of the communication that could hide behind compute does:
    /// 1 = perfect prefetch (zeropp's engine on the emulated cluster), 0 =
    /// none (communication and compute in sequence).
    pub overlap: f64,
}

/// A set of switches the model compares.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Config {
    pub name: &'static str,
    /// Weight bits on the wire across nodes (16 = bf16).
    pub weight_bits: u32,
    pub hpz: bool,
    pub qgz: bool,
    /// zeropp's default beyond ZeRO++: the weights cross nodes as
    /// differences (`weight_bits`) and travel inside the node in bf16 (the
    /// references, and hpZ's secondary shard), refreshed in bf16 every
    /// `qwz_refresh` gathers; qgZ's hop across nodes is rotated, in blocks
    /// of `qgz_inter_block`.
    pub beyond: bool,
}

const fn cfg(name: &'static str, weight_bits: u32, hpz: bool, qgz: bool, beyond: bool) -> Config {
    Config {
        name,
        weight_bits,
        hpz,
        qgz,
        beyond,
    }
}

pub const CONFIGS: [Config; 8] = [
    cfg("zero3", 16, false, false, false),
    cfg("qwz", 8, false, false, false),
    cfg("qwz+hpz", 8, true, false, false),
    cfg("zeropp", 4, true, true, true),
    cfg("zeropp-published", 8, true, true, false),
    cfg("zeropp-int4-weights", 4, true, true, false),
    cfg("hpz", 16, true, false, false),
    cfg("qgz", 16, false, true, false),
];

/// The configuration of that name in [`CONFIGS`].
pub fn config(name: &str) -> Config {
    *CONFIGS
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no planner configuration named {name}"))
}

#[derive(Clone, Debug, Serialize)]
pub struct Prediction {
    pub config: Config,
    pub forward_gather_s: f64,
    pub backward_gather_s: f64,
    pub gradient_s: f64,
    pub quantization_s: f64,
    pub compute_s: f64,
    /// Communication the compute does not hide.
    pub exposed_comm_s: f64,
    pub step_s: f64,
    /// Bytes each node sends to other nodes per step.
    pub inter_node_bytes: f64,
}

impl PlanInput {
    /// The emulated 2 x 2 cluster of docs/BENCHMARKS.md: the default
    /// model (138,240 parameters once padded for 4 ranks), TCP on loopback
    /// inside a node, each node's egress shaped to `mbit` Mbit/s.
    pub fn emulated_cluster(mbit: f64) -> PlanInput {
        PlanInput {
            params: 138_240.0,
            nodes: 2,
            ranks_per_node: 2,
            intra_gbps: 1.0,
            nic_gbit: mbit / 1000.0,
            nics_per_node: 1,
            alpha_s: 100e-6,
            compute_s: 0.60,
            quant_gbps: 2.0,
            units: 4,
            block: 256.0,
            qgz_block: 32.0,
            // The recorded runs used int4 on both qgZ hops.
            qgz_intra_bits: 4,
            qgz_inter_block: 64.0,
            qwz_refresh: 100.0,
            overlap: 1.0,
        }
    }

    pub fn world(&self) -> f64 {
        (self.nodes * self.ranks_per_node) as f64
    }
    /// Bytes per second a node can send to other nodes.
    fn nic_bps(&self) -> f64 {
        self.nic_gbit * 1e9 / 8.0 * self.nics_per_node as f64
    }
    fn intra_bps(&self) -> f64 {
        self.intra_gbps * 1e9
    }
    /// Bytes of Ψ values at `bits` per value with one f32 per `block`.
    fn bytes(&self, bits: u32, block: f64) -> f64 {
        if bits == 16 {
            2.0 * self.params
        } else {
            self.params * (bits as f64 / 8.0 + 4.0 / block)
        }
    }

    /// A ring collective over all W ranks, ordered node by node: the link
    /// leaving each node carries (W−1)/W of `m`. Returns (seconds, bytes
    /// per node across).
    fn flat_ring(&self, m: f64) -> (f64, f64) {
        let w = self.world();
        let across = if self.nodes > 1 {
            (w - 1.0) / w * m
        } else {
            0.0
        };
        let inside = (w - 1.0) / w * m / self.intra_bps();
        (
            (w - 1.0) * self.alpha_s + (across / self.nic_bps()).max(inside),
            across,
        )
    }

    /// A hop among `p` equal-local ranks of different nodes, every rank
    /// sending (p−1)/p of `m_per_rank`; the node's G ranks share its NICs.
    fn across_hop(&self, m_per_rank: f64) -> (f64, f64) {
        let p = self.nodes as f64;
        if self.nodes == 1 {
            return (0.0, 0.0);
        }
        let per_node = (p - 1.0) / p * m_per_rank * self.ranks_per_node as f64;
        (
            (p - 1.0) * self.alpha_s + per_node / self.nic_bps(),
            per_node,
        )
    }

    fn inside_hop(&self, m: f64) -> f64 {
        let g = self.ranks_per_node as f64;
        if self.ranks_per_node == 1 {
            return 0.0;
        }
        (g - 1.0) * self.alpha_s + (g - 1.0) / g * m / self.intra_bps()
    }

    pub fn predict(&self, c: Config) -> Prediction {
        let g = self.ranks_per_node as f64;
        let w = self.world();
        let weights = self.bytes(c.weight_bits, self.block);
        let (mut inter, mut quant_values) = (0.0, 0.0);
        let bf16 = self.bytes(16, self.block);
        // A gather of weight differences: across among equal local ranks
        // (the refresh's bf16 once every `qwz_refresh` gathers), then every
        // reference in bf16 inside the node.
        let delta_gather = |inter: &mut f64, quant_values: &mut f64| {
            let every = self.qwz_refresh.max(1.0);
            let (t, b) = self.across_hop(weights / g);
            let (tr, br) = self.across_hop(bf16 / g);
            *inter += b + (br - b) / every;
            *quant_values += self.params / w + self.params / g;
            t + (tr - t) / every + self.inside_hop(bf16)
        };
        // Forward gather.
        let forward = if c.beyond {
            delta_gather(&mut inter, &mut quant_values)
        } else if c.weight_bits == 16 {
            let (t, b) = self.flat_ring(weights);
            inter += b;
            t
        } else {
            // Across among equal local ranks (each holds Ψ/W, gathers
            // N chunks = Ψ/G), then the bundles within the node.
            let (t, b) = self.across_hop(weights / g);
            inter += b;
            quant_values += self.params / w + self.params; // quantize mine, dequantize all
            t + self.inside_hop(weights)
        };
        // Backward gather: hpZ stays inside the node (from its secondary
        // shard, quantized or bf16 as the forward gather was).
        let backward = if c.hpz && c.beyond {
            self.inside_hop(bf16)
        } else if c.hpz {
            if c.weight_bits != 16 {
                quant_values += self.params;
            }
            self.inside_hop(weights)
        } else if c.beyond {
            delta_gather(&mut inter, &mut quant_values)
        } else if c.weight_bits == 16 {
            let (t, b) = self.flat_ring(weights);
            inter += b;
            t
        } else {
            let (t, b) = self.across_hop(weights / g);
            inter += b;
            quant_values += self.params;
            t + self.inside_hop(weights)
        };
        let gradient = self.gradient_hop(c, &mut inter, &mut quant_values);
        let quantization = quant_values * 4.0 / (self.quant_gbps * 1e9);
        let comm = forward + backward + gradient;
        // Prefetch hides each unit's gather behind the previous unit's
        // compute, and each gradient behind the next unit's backward: what
        // is left is the excess over compute, plus one unit's share that
        // nothing can hide — or more, when overlap is partial.
        let u = self.units.max(1) as f64;
        let hideable = comm.min(self.compute_s) * (1.0 - 1.0 / u);
        let exposed = comm - self.overlap.clamp(0.0, 1.0) * hideable;
        Prediction {
            config: c,
            forward_gather_s: forward,
            backward_gather_s: backward,
            gradient_s: gradient,
            quantization_s: quantization,
            compute_s: self.compute_s,
            exposed_comm_s: exposed,
            step_s: self.compute_s + quantization + exposed,
            inter_node_bytes: inter,
        }
    }

    /// The gradient's reduce-scatter: its seconds; its bytes across nodes
    /// and values quantized added to `inter` and `quant_values`.
    fn gradient_hop(&self, c: Config, inter: &mut f64, quant_values: &mut f64) -> f64 {
        let g = self.ranks_per_node as f64;
        if c.qgz {
            let q1 = self.bytes(self.qgz_intra_bits, self.qgz_block);
            let inter_block = if c.beyond {
                self.qgz_inter_block
            } else {
                self.qgz_block
            };
            let q4 = self.bytes(4, inter_block);
            // Hop 1 inside: all-to-all of the whole quantized gradient; hop
            // 2 across: each rank's int4 node-level partial (Ψ/G), rotated
            // and back in `beyond`.
            let (t, b) = self.across_hop(q4 / g);
            *inter += b;
            // Hop 1 quantized and dequantized (not in bf16), hop 2's
            // requantization of the node's partial.
            if self.qgz_intra_bits != 16 {
                *quant_values += 2.0 * self.params;
            }
            *quant_values += self.params / g;
            if c.beyond {
                *quant_values += 2.0 * self.params / g;
            }
            self.inside_hop(q1) + t
        } else {
            let (t, b) = self.flat_ring(2.0 * self.params);
            *inter += b;
            t
        }
    }

    /// Every configuration, fastest first.
    pub fn compare(&self) -> Vec<Prediction> {
        let mut v: Vec<Prediction> = CONFIGS.iter().map(|&c| self.predict(c)).collect();
        v.sort_by(|a, b| a.step_s.total_cmp(&b.step_s));
        v
    }
}

/// Why islands cannot be predicted or chosen: what to give instead.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum IslandsError {
    #[error(
        "{islands} islands of {nodes} nodes syncing every {h} steps in {fragments} fragments: the \
         islands (2 or more) divide the nodes, H and the fragments are at least 1"
    )]
    Shape {
        islands: usize,
        nodes: usize,
        h: usize,
        fragments: usize,
    },
    #[error(
        "{given} link rates between consecutive nodes for {nodes} nodes: give nodes − 1 positive \
         rates"
    )]
    Seams { given: usize, nodes: usize },
    #[error(
        "islands syncing every {h} steps in {fragments} fragments: H and the fragments are at \
         least 1"
    )]
    Schedule { h: usize, fragments: usize },
}

/// What islands (`zeropp train --islands N --sync-every H`) would do: the
/// inner step of one island (the fastest configuration on its own nodes),
/// one outer exchange of the whole model across the islands, and the step
/// with the exchange every H steps — waited for, or streamed in `fragments`
/// that each land `delay` inner steps after they start.
#[derive(Clone, Debug, Serialize)]
pub struct IslandsPrediction {
    pub islands: usize,
    pub sync_every: usize,
    pub fragments: usize,
    pub delay: usize,
    /// The island's own step, and the configuration it runs.
    pub inner_step_s: f64,
    pub inner_config: &'static str,
    /// One exchange of the whole model (int4 blocks of 64 with their
    /// scales: an all-to-all and an all-gather of (R−1)/R of a shard per
    /// rank, the node's ranks sharing its NICs), and the bytes each node
    /// sends across for it.
    pub exchange_s: f64,
    pub exchange_bytes_per_node: f64,
    /// The mean step, syncs included.
    pub step_s: f64,
    /// Bytes each node sends across per step (the exchanges only: nothing
    /// else leaves an island of one node).
    pub inter_node_bytes_per_step: f64,
    /// The smallest H whose inner steps hide one exchange.
    pub hiding_sync_every: usize,
}

impl PlanInput {
    /// The islands' prediction: `islands` islands of consecutive whole
    /// nodes (a divisor of the nodes), an exchange every `h` steps in
    /// `fragments` landing `delay` steps later (0: waited for).
    pub fn predict_islands(
        &self,
        islands: usize,
        h: usize,
        fragments: usize,
        delay: usize,
    ) -> Result<IslandsPrediction, IslandsError> {
        if islands < 2 || !self.nodes.is_multiple_of(islands) || h == 0 || fragments == 0 {
            return Err(IslandsError::Shape {
                islands,
                nodes: self.nodes,
                h,
                fragments,
            });
        }
        let (best, exchange, per_node, step) =
            self.islands_step(islands, self.nic_gbit, self.nic_gbit, (h, fragments, delay));
        let inner = best.step_s;
        Ok(IslandsPrediction {
            islands,
            sync_every: h,
            fragments,
            delay,
            inner_step_s: inner,
            inner_config: best.config.name,
            exchange_s: exchange,
            exchange_bytes_per_node: per_node,
            step_s: step,
            inter_node_bytes_per_step: per_node / h as f64,
            hiding_sync_every: hiding_sync_every(exchange, inner),
        })
    }
}

impl PlanInput {
    /// One outer exchange of the whole model across `islands` islands
    /// over this input's NICs: its seconds and the bytes each node sends.
    /// Per rank: its shard, (R−1)/R of it in the all-to-all and the same
    /// again in the all-gather, at 4 bits and an f32 pair per 64.
    fn exchange(&self, islands: usize) -> (f64, f64) {
        let r = islands as f64;
        let shard = self.params / (self.world() / r);
        let per_rank = 2.0 * (r - 1.0) / r * shard * (0.5 + 8.0 / 64.0);
        let per_node = per_rank * self.ranks_per_node as f64;
        (
            2.0 * (r - 1.0) * self.alpha_s + per_node / self.nic_bps(),
            per_node,
        )
    }

    /// `islands` islands of this job: the island's fastest configuration
    /// (its step on `inside_gbit` NICs between its nodes), one exchange of
    /// the whole model over `across_gbit` NICs (seconds, bytes per node),
    /// and the mean step with that exchange every H inner steps, `(h,
    /// fragments, delay)` as `predict_islands` takes them (one island: its
    /// step alone).
    fn islands_step(
        &self,
        islands: usize,
        inside_gbit: f64,
        across_gbit: f64,
        (h, fragments, delay): (usize, usize, usize),
    ) -> (Prediction, f64, f64, f64) {
        let island = PlanInput {
            nodes: self.nodes / islands,
            nic_gbit: inside_gbit,
            ..self.clone()
        };
        let best = island
            .compare()
            .into_iter()
            .next()
            .expect("configurations to compare");
        if islands == 1 {
            let step = best.step_s;
            return (best, 0.0, 0.0, step);
        }
        let over = PlanInput {
            nic_gbit: across_gbit,
            ..self.clone()
        };
        let (exchange, per_node) = over.exchange(islands);
        let inner = best.step_s;
        let step = inner + exposed_exchange(exchange, inner, h, fragments, delay) / h as f64;
        (best, exchange, per_node, step)
    }

    /// Which islands this job should train as, from the NIC rate of each
    /// link between consecutive nodes (`seams_gbit`, Gbit/s, nodes − 1 of
    /// them, as the probe at join measures them) and the outer sync the run would
    /// use (`h` steps, `fragments`, `delay`): every count of islands of
    /// whole consecutive nodes is predicted (its island's step on the
    /// island's own slowest seam, its exchange on the slowest seam it
    /// cuts); islands are proposed only when they step at least
    /// [`ISLANDS_WORTH`]× faster than the synchronous job: the fewest that
    /// do and whose step is within [`NEAR_FASTEST`] of the fastest's.
    pub fn choose_islands(
        &self,
        seams_gbit: &[f64],
        h: usize,
        fragments: usize,
        delay: usize,
    ) -> Result<IslandsChoice, IslandsError> {
        if seams_gbit.len() + 1 != self.nodes || seams_gbit.iter().any(|s| s.is_nan() || *s <= 0.0)
        {
            return Err(IslandsError::Seams {
                given: seams_gbit.len(),
                nodes: self.nodes,
            });
        }
        if h == 0 || fragments == 0 {
            return Err(IslandsError::Schedule { h, fragments });
        }
        // The slowest of the seams `keep` picks (infinite where none).
        let slowest = |keep: &dyn Fn(usize) -> bool| {
            (0..seams_gbit.len())
                .filter(|&p| keep(p))
                .map(|p| seams_gbit[p])
                .fold(f64::INFINITY, f64::min)
        };
        let mut candidates = Vec::new();
        for islands in (1..=self.nodes).filter(|k| self.nodes.is_multiple_of(*k)) {
            let size = self.nodes / islands;
            let cut = |p: usize| (p + 1).is_multiple_of(size);
            let inside = slowest(&|p| !cut(p));
            let inside = if inside.is_finite() {
                inside
            } else {
                self.nic_gbit
            };
            let (_, _, _, step) =
                self.islands_step(islands, inside, slowest(&cut), (h, fragments, delay));
            candidates.push(IslandsCandidate {
                islands,
                step_s: step,
            });
        }
        let synchronous = candidates[0].step_s;
        let fastest = candidates
            .iter()
            .map(|c| c.step_s)
            .fold(f64::INFINITY, f64::min);
        // Islands at least ISLANDS_WORTH× faster than the synchronous job,
        // the fewest within NEAR_FASTEST of the fastest; else one job (also
        // when a prediction is not a finite time).
        let chosen = candidates
            .iter()
            .filter(|c| c.islands > 1 && c.step_s.is_finite() && synchronous.is_finite())
            .find(|c| c.step_s <= NEAR_FASTEST * fastest && ISLANDS_WORTH * c.step_s <= synchronous)
            .unwrap_or(&candidates[0]);
        let why = if chosen.islands == 1 {
            format!(
                "synchronous: the job's step is predicted {synchronous:.4} s, islands' fastest \
                 {fastest:.4} s ({:.2}x faster, below the {ISLANDS_WORTH}x that islands' \
                 staleness is worth)",
                synchronous / fastest
            )
        } else {
            format!(
                "{} islands of {}: predicted {:.4} s a step against the synchronous job's \
                 {synchronous:.4} s ({:.2}x faster)",
                chosen.islands,
                zeropp_comm::count(self.nodes / chosen.islands, "node"),
                chosen.step_s,
                synchronous / chosen.step_s
            )
        };
        Ok(IslandsChoice {
            islands: chosen.islands,
            step_s: chosen.step_s,
            synchronous_step_s: synchronous,
            candidates,
            why,
        })
    }
}

/// How much faster than the synchronous job islands must step before the
/// plan proposes them: they train with H steps of staleness between them.
pub const ISLANDS_WORTH: f64 = 1.5;
/// Of the counts of islands fast enough, the fewest (the largest islands)
/// whose step is within this factor of the fastest count's.
pub const NEAR_FASTEST: f64 = 1.15;

/// One count of islands the plan weighed, and its predicted step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct IslandsCandidate {
    pub islands: usize,
    pub step_s: f64,
}

/// The islands the plan proposes, and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct IslandsChoice {
    pub islands: usize,
    pub step_s: f64,
    pub synchronous_step_s: f64,
    pub candidates: Vec<IslandsCandidate>,
    pub why: String,
}

/// What an exchange of `exchange_s` every `h` inner steps of `inner_s`
/// adds to the steps that wait for it: waited for (`delay` 0), all of it;
/// streamed in `fragments` landing `delay` steps after they start, each
/// fragment's share beyond those steps, and never less than what the
/// islands' thread cannot fit in H steps.
fn exposed_exchange(
    exchange_s: f64,
    inner_s: f64,
    h: usize,
    fragments: usize,
    delay: usize,
) -> f64 {
    let (hf, f) = (h as f64, fragments as f64);
    if delay == 0 {
        exchange_s
    } else {
        (f * (exchange_s / f - delay as f64 * inner_s).max(0.0)).max(exchange_s - hf * inner_s)
    }
}

/// The smallest H whose inner steps of `inner_s` hide an exchange of
/// `exchange_s` (the plan's prediction, and a run's own measurement).
pub fn hiding_sync_every(exchange_s: f64, inner_s: f64) -> usize {
    (exchange_s / inner_s.max(1e-12)).ceil().max(1.0) as usize
}

/// The islands table `zeropp plan --islands` prints.
pub fn render_islands(input: &PlanInput, preds: &[IslandsPrediction]) -> String {
    let Some(first) = preds.first() else {
        return String::new();
    };
    let sync = input.compare().into_iter().next().expect("configurations");
    let mut s = format!(
        "\nislands: {} of {}; an island's step {:.4} s ({}), one exchange of the whole \
         model {:.4} s ({:.3} MB per node); synchronous on the whole job: {:.4} s ({})\n",
        first.islands,
        zeropp_comm::count(input.nodes / first.islands, "node"),
        first.inner_step_s,
        first.inner_config,
        first.exchange_s,
        first.exchange_bytes_per_node / 1e6,
        sync.step_s,
        sync.config.name
    );
    s += &format!(
        "  {:>6} {:>9} {:>6} {:>11} {:>14} {:>16}\n",
        "H", "fragments", "delay", "step (s)", "vs island's", "MB across/step"
    );
    for p in preds {
        s += &format!(
            "  {:>6} {:>9} {:>6} {:>11.4} {:>13.3}x {:>16.4}\n",
            p.sync_every,
            p.fragments,
            p.delay,
            p.step_s,
            p.step_s / p.inner_step_s,
            p.inter_node_bytes_per_step / 1e6
        );
    }
    s += &format!(
        "  H >= {} hides an exchange behind the inner steps (streamed: --outer-fragments F \
         --outer-delay D with each fragment's exchange within D steps)\n",
        first.hiding_sync_every
    );
    s
}

/// `zeropp train` flags that run configuration `c`.
pub fn train_flags(c: Config) -> String {
    match c.name {
        "zero3" => "--mode zero3".to_string(),
        "zeropp" => "--mode zeropp".to_string(),
        "zeropp-published" => {
            "--mode zeropp --qwz-delta false --qgz-hadamard false --qgz-inter-block 32".to_string()
        }
        _ => format!(
            "--mode zero3 --qwz-bits {} --hpz {} --qgz {}",
            if c.weight_bits == 16 {
                0
            } else {
                c.weight_bits
            },
            c.hpz,
            c.qgz
        ),
    }
}

/// The table `zeropp plan` prints, and its recommendation.
pub fn render(input: &PlanInput, tokens_per_step: f64) -> String {
    let preds = input.compare();
    let zero3 = input.predict(config("zero3"));
    let mut s = format!(
        "{:.3e} parameters, {}, {:.1} GB/s inside, {} x {} Gbit/s per node across, compute {:.3} s/step\n\n",
        input.params,
        zeropp_comm::shape(input.nodes, input.ranks_per_node),
        input.intra_gbps,
        input.nics_per_node,
        input.nic_gbit,
        input.compute_s
    );
    s += &format!(
        "{:<20} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11} {:>9}\n",
        "config",
        "fwd-ag s",
        "bwd-ag s",
        "grad s",
        "quant s",
        "compute",
        "exposed",
        "step s",
        "tokens/s",
        "vs zero3"
    );
    for p in &preds {
        s += &format!(
            "{:<20} {:>9.4} {:>9.4} {:>9.4} {:>9.4} {:>9.4} {:>9.4} {:>9.4} {:>11.0} {:>8.2}x\n",
            p.config.name,
            p.forward_gather_s,
            p.backward_gather_s,
            p.gradient_s,
            p.quantization_s,
            p.compute_s,
            p.exposed_comm_s,
            p.step_s,
            tokens_per_step / p.step_s,
            zero3.step_s / p.step_s
        );
    }
    let best = &preds[0];
    let c = best.config;
    let switches = train_flags(c);
    s += &format!(
        "\nrecommended: {} ({switches}): {:.2}x ZeRO-3's speed; communication left exposed {:.3} s of {:.3} s\n",
        c.name,
        zero3.step_s / best.step_s,
        best.exposed_comm_s,
        best.step_s
    );
    if c.weight_bits == 4 && !c.beyond {
        let int4 = input.predict(config("zeropp"));
        s += &format!(
            "int4 weights themselves carry about 18x the rounding error of int8 (127/7 levels) (check yours with `zeropp quant-error FILE --bits 4`); as differences (--mode zeropp, at loss parity) they would give {:.2}x\n",
            zero3.step_s / int4.step_s
        );
    }
    if zero3.exposed_comm_s < 0.05 * zero3.step_s {
        s += "the links are fast enough that ZeRO-3 is compute-bound here: ZeRO++ saves bytes, not time\n";
    }
    s
}

/// The line `zeropp plan --measured` adds: the run's predicted step beside
/// its measured one (`run`: the JSON it prints with `--json`).
pub fn render_run(run: &serde_json::Value) -> String {
    let c = &run["config"];
    let what = format!(
        "the measured run ({} weights{}{}{})",
        match c["weight_bits"].as_u64() {
            Some(16) | None => "bf16".to_string(),
            Some(b) if c["beyond"] == true => format!("int{b} difference"),
            Some(b) => format!("int{b}"),
        },
        if c["hpz"] == true { ", hpZ" } else { "" },
        if c["qgz"] == true { ", qgZ" } else { "" },
        if c["beyond"] == true && c["qgz"] == true {
            ", rotated gradient hop"
        } else {
            ""
        },
    );
    let predicted = run["predicted_step_s"].as_f64().unwrap_or(f64::NAN);
    match (run["measured_step_s"].as_f64(), run["error"].as_f64()) {
        (Some(m), Some(e)) => format!(
            "{what}: predicted {predicted:.4} s a step, measured {m:.4} s ({:+.1}%)",
            e * 100.0
        ),
        _ => format!("{what}: predicted {predicted:.4} s a step (the summary has no median step)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ZeRO-3's and ZeRO++'s predicted step times within 25% of `z3`, `zpp`.
    fn assert_within_25_percent(input: &PlanInput, z3: f64, zpp: f64, what: &str) {
        for (c, want) in [(config("zero3"), z3), (config("zeropp-published"), zpp)] {
            let got = input.predict(c).step_s;
            let err = (got - want) / want;
            assert!(
                err.abs() <= 0.25,
                "{} {what}: predicted {got:.3} s, measured {want:.3} s ({:+.0}%)",
                c.name,
                err * 100.0
            );
        }
    }

    fn emulated(mbit: f64) -> PlanInput {
        PlanInput::emulated_cluster(mbit)
    }

    /// The 3.76M GPT of the islands bench on `nodes` nodes x 2 ranks.
    fn gpt(nodes: usize) -> PlanInput {
        PlanInput {
            params: 3_758_592.0,
            nodes,
            compute_s: 0.14,
            units: 4,
            ..emulated(1000.0)
        }
    }

    #[test]
    fn islands_are_proposed_where_the_link_is_most_of_the_step_and_not_where_it_is_fast() {
        let slow = gpt(2).choose_islands(&[0.03], 20, 1, 0).unwrap();
        assert_eq!(slow.islands, 2, "{slow:?}");
        assert!(
            slow.synchronous_step_s >= ISLANDS_WORTH * slow.step_s,
            "{slow:?}"
        );
        assert!(slow.why.contains("2 islands of 1 node"), "{}", slow.why);
        let fast = gpt(2).choose_islands(&[10.0], 20, 1, 0).unwrap();
        assert_eq!(fast.islands, 1, "{fast:?}");
        assert!(fast.why.starts_with("synchronous"), "{}", fast.why);
        assert_eq!(fast.candidates.len(), 2, "{fast:?}");
    }

    #[test]
    fn islands_are_cut_at_the_slow_link_between_two_sites() {
        // 4 nodes: two sites of two nodes joined by 30 Mbit/s.
        let sites = gpt(4)
            .choose_islands(&[10.0, 0.03, 10.0], 20, 1, 0)
            .unwrap();
        assert_eq!(sites.islands, 2, "{sites:?}");
        let counts: Vec<usize> = sites.candidates.iter().map(|c| c.islands).collect();
        assert_eq!(counts, [1, 2, 4]);
        // The same slow link between the first two nodes: no cut of equal
        // islands keeps it outside an island but one node each.
        let first = gpt(4)
            .choose_islands(&[0.03, 10.0, 10.0], 20, 1, 0)
            .unwrap();
        assert_eq!(first.islands, 4, "{first:?}");
    }

    #[test]
    fn choosing_islands_refuses_seams_that_do_not_fit_the_nodes() {
        for seams in [
            &[1.0][..],
            &[1.0, 1.0, 1.0, 1.0],
            &[1.0, 0.0, 1.0],
            &[1.0, f64::NAN, 1.0],
        ] {
            let e = gpt(4).choose_islands(seams, 20, 1, 0).unwrap_err();
            assert!(matches!(e, IslandsError::Seams { nodes: 4, .. }), "{e:?}");
            assert!(
                e.to_string().contains("nodes − 1 positive rates"),
                "{seams:?}: {e}"
            );
        }
        let e = gpt(2).choose_islands(&[1.0], 0, 1, 0).unwrap_err();
        assert_eq!(e, IslandsError::Schedule { h: 0, fragments: 1 });
        assert!(e.to_string().contains("at least 1"), "{e}");
        // One node, or steps that are no finite time: one job, no panic.
        assert_eq!(gpt(1).choose_islands(&[], 20, 1, 0).unwrap().islands, 1);
        let endless = PlanInput {
            compute_s: f64::INFINITY,
            ..gpt(2)
        };
        assert_eq!(
            endless.choose_islands(&[0.03], 20, 1, 0).unwrap().islands,
            1
        );
    }

    #[test]
    fn bytes_across_nodes_match_the_engine_count() {
        // The engine counted 1,244,160 bytes across nodes per ZeRO-3 step
        // for this model (both nodes; metrics aside): 3 collectives x 3/4 x
        // 2 bytes x Ψ per node.
        let z3 = emulated(1.0).predict(config("zero3"));
        assert!((2.0 * z3.inter_node_bytes - 1_244_160.0).abs() < 1.0);
        // ZeRO++: int8 forward gather across nodes (1/2 of the weights per
        // node, scales included) and the int4 gradient's second hop.
        let zpp = emulated(1.0).predict(config("zeropp-published"));
        let psi = 138_240.0;
        let want = 2.0 * (0.5 * psi * (1.0 + 4.0 / 256.0) + 0.5 * psi * (0.5 + 4.0 / 32.0));
        assert!((2.0 * zpp.inter_node_bytes - want).abs() < 1.0);
        assert!(zpp.inter_node_bytes / z3.inter_node_bytes <= 0.27);
        // The default: the engine counted 0.147 MB across nodes a step over
        // 400 steps, refreshes included, 0.118x ZeRO-3's (docs/TRAINING.md).
        let beyond = emulated(1.0).predict(config("zeropp"));
        let ratio = beyond.inter_node_bytes / z3.inter_node_bytes;
        assert!((ratio - 0.118).abs() < 0.006, "{ratio}");
    }

    #[test]
    fn predictions_are_within_25_percent_of_the_emulated_cluster() {
        // Median step times measured by bench-cluster/run.sh (docs/BENCHMARKS.md).
        let measured = [
            (1.0, 5.3432, 1.1405),
            (2.0, 2.6480, 0.8114),
            (5.0, 1.0687, 0.6151),
            (20.0, 0.6267, 0.6228),
            (100.0, 0.5791, 0.6353),
            (1000.0, 0.6236, 0.6475),
        ];
        for (mbit, z3, zpp) in measured {
            assert_within_25_percent(&emulated(mbit), z3, zpp, &format!("{mbit} Mbit/s"));
        }
    }

    #[test]
    fn predictions_hold_for_a_wide_model_from_30_mbit_to_10_gbit() {
        // The 3.76M-parameter model of docs/BENCHMARKS.md's sweep (width
        // 384, 2 layers), 2, 3 and 4 nodes x 2 ranks; compute calibrated
        // from ZeRO-3 at 10 Gbit/s (0.747 s, 0.909 s and 1.348 s). The
        // 3-node runs were made with int8 on qgZ's first hop, the others
        // with int4.
        let measured = [
            (2, 30.0, 5.1812, 1.3902),
            (2, 100.0, 1.8292, 1.0097),
            (2, 300.0, 0.8629, 0.6548),
            (2, 1000.0, 0.8814, 0.8456),
            (2, 10_000.0, 0.7470, 0.6581),
            (3, 100.0, 1.8840, 1.2048),
            (3, 1000.0, 1.0482, 0.9501),
            (3, 10_000.0, 0.9094, 0.9703),
            (4, 100.0, 2.1363, 1.5977),
            (4, 1000.0, 1.3450, 1.3471),
            (4, 10_000.0, 1.3476, 1.3727),
        ];
        for (nodes, mbit, z3, zpp) in measured {
            let input = PlanInput {
                params: 3_758_592.0,
                nodes,
                compute_s: [0.747, 0.9094, 1.348][nodes - 2],
                qgz_intra_bits: if nodes == 3 { 8 } else { 4 },
                ..emulated(mbit)
            };
            assert_within_25_percent(&input, z3, zpp, &format!("{nodes} nodes at {mbit} Mbit/s"));
        }
    }

    #[test]
    fn predictions_hold_at_the_rate_a_probe_measured() {
        // The wide model on 2 x 2 at 30 and 100 Mbit/s and on 3 and 4 nodes
        // x 2 ranks at 5 Mbit/s
        // (docs/BENCHMARKS.md), given the link rate bench-cluster's TCP
        // probe measured on the same shaped links before the runs (one flow
        // from each node to the next, Mbit/s of payload),
        // not a rate derived from the runs themselves. Compute calibrated
        // from ZeRO-3 at 10 Gbit/s (0.747 s, 0.9094 s and 1.348 s). Int8
        // inside the node on qgZ's first hop; 5 Mbit/s over UCX with
        // rendezvous, then everything with eager sends (today's default),
        // each with its own probe.
        for (nodes, probe_mbit, compute_s, z3, zpp) in [
            (2, 27.301, 0.747, 5.3406, 1.3259),
            (2, 95.420, 0.747, 1.5403, 0.7510),
            (3, 4.580, 0.9094, 37.6024, 9.1088),
            (4, 4.352, 1.348, 39.8835, 10.3260),
            (3, 4.413, 0.9094, 38.2775, 9.2472),
            (4, 4.277, 1.348, 39.9656, 10.3900),
        ] {
            let input = PlanInput {
                params: 3_758_592.0,
                nodes,
                compute_s,
                qgz_intra_bits: 8,
                ..emulated(probe_mbit)
            };
            let what = format!("{nodes} nodes, probe {probe_mbit} Mbit/s");
            assert_within_25_percent(&input, z3, zpp, &what);
        }
    }

    #[test]
    fn predictions_hold_for_the_default_model_on_3_and_4_nodes() {
        // docs/BENCHMARKS.md, "Emulated cluster: 3 and 4 nodes": the
        // default model padded for 6 and 8 ranks, compute calibrated from
        // ZeRO-3 at 100 Mbit/s (1.04 s and 1.36 s).
        for (nodes, params, compute_s, mbit, z3, zpp) in [
            (3, 139_776.0, 1.04, 2.0, 2.9831, 1.3372),
            (3, 139_776.0, 1.04, 100.0, 1.0985, 1.0588),
            (4, 141_312.0, 1.36, 2.0, 3.1965, 1.8215),
            (4, 141_312.0, 1.36, 100.0, 1.4168, 1.5736),
        ] {
            let input = PlanInput {
                params,
                nodes,
                compute_s,
                ..emulated(mbit)
            };
            assert_within_25_percent(&input, z3, zpp, &format!("{nodes} nodes at {mbit} Mbit/s"));
        }
    }

    #[test]
    fn predictions_hold_for_each_switch_alone() {
        // The wide model on 2 x 2 at 100 Mbit/s with one ZeRO++ switch on
        // (docs/BENCHMARKS.md, "One switch at a time").
        let input = PlanInput {
            params: 3_758_592.0,
            compute_s: 0.747,
            ..emulated(100.0)
        };
        for (name, measured) in [
            ("zero3", 1.829),
            ("qwz", 1.106),
            ("hpz", 1.293),
            ("qgz", 1.210),
            ("zeropp-published", 1.010),
        ] {
            let got = input.predict(config(name)).step_s;
            let err = (got - measured) / measured;
            assert!(
                err.abs() <= 0.25,
                "{name}: predicted {got:.3} s, measured {measured:.3} s ({:+.0}%)",
                err * 100.0
            );
        }
        // hpZ alone moves the backward gather off the link: a third of
        // ZeRO-3's bytes across nodes, as the engine counted (26.3 of 37.6 MB).
        let z3 = input.predict(config("zero3")).inter_node_bytes;
        let hpz = input.predict(config("hpz")).inter_node_bytes;
        assert!((hpz / z3 - 2.0 / 3.0).abs() < 1e-9, "{hpz} vs {z3}");
    }

    #[test]
    fn train_flags_name_each_configuration() {
        assert_eq!(train_flags(config("zeropp")), "--mode zeropp");
        assert_eq!(
            train_flags(config("zeropp-published")),
            "--mode zeropp --qwz-delta false --qgz-hadamard false --qgz-inter-block 32"
        );
        assert_eq!(
            train_flags(config("hpz")),
            "--mode zero3 --qwz-bits 0 --hpz true --qgz false"
        );
        assert_eq!(
            train_flags(config("zeropp-int4-weights")),
            "--mode zero3 --qwz-bits 4 --hpz true --qgz true"
        );
    }

    #[test]
    fn partial_overlap_exposes_communication() {
        // With no overlap the step is compute + all communication.
        let fast = PlanInput {
            overlap: 0.0,
            ..emulated(100.0)
        };
        let p = fast.predict(config("zero3"));
        let comm = p.forward_gather_s + p.backward_gather_s + p.gradient_s;
        assert!((p.step_s - (p.compute_s + p.quantization_s + comm)).abs() < 1e-12);
        let full = emulated(100.0).predict(config("zero3"));
        assert!(full.step_s < p.step_s);
    }

    #[test]
    fn the_recommendation_follows_the_link() {
        // On a slow link the default (int4 differences, a rotated gradient
        // hop in blocks of 64) sends the fewest bytes.
        let slow = emulated(1.0).compare();
        assert_eq!(slow[0].config.name, "zeropp");
        let text = render(&emulated(10_000.0), 2048.0);
        assert!(text.contains("compute-bound"), "{text}");
    }

    #[test]
    fn islands_hide_the_exchange_from_the_h_the_link_allows() {
        // The 3.76M GPT at 10 Mbit/s: about 1.9 MB per node per exchange.
        let input = PlanInput {
            params: 3.76e6,
            compute_s: 0.12,
            ..PlanInput::emulated_cluster(10.0)
        };
        let p = input.predict_islands(2, 20, 1, 0).unwrap();
        assert!(
            (p.exchange_bytes_per_node - 2.0 * (2.0 * 0.5 * 1.88e6 * 0.625)).abs() < 1e3,
            "{p:?}"
        );
        assert!(p.exchange_s > 1.0 && p.exchange_s < 2.5, "{p:?}");
        // Waited for: the exchange over H steps; more steps, less of it.
        let p50 = input.predict_islands(2, 50, 1, 0).unwrap();
        assert!(p.step_s > p50.step_s && p50.step_s > p.inner_step_s);
        assert!((p.step_s - p.inner_step_s - p.exchange_s / 20.0).abs() < 1e-9);
        // Streamed from the H that hides it: the island's own step.
        let h = p.hiding_sync_every;
        let s = input.predict_islands(2, 2 * h, 4, h / 2).unwrap();
        assert!((s.step_s - s.inner_step_s).abs() < 1e-9, "{s:?}");
        // Below it the islands' thread cannot keep up.
        let short = input.predict_islands(2, h / 2, 4, 1).unwrap();
        assert!(short.step_s > short.inner_step_s);
        assert!(input.predict_islands(3, 20, 1, 0).is_err());
    }
}
