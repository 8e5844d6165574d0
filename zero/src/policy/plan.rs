//! The plan: every switch read once, at start, into the wire formats and
//! groups the engine uses. The hot paths read the plan, never the config.

use std::collections::BTreeMap;

use crate::routing::{ClusterView, RoutingError};
use serde::{Deserialize, Serialize};
use zeropp_quant::{Bits, QuantFormat, Scheme};

use crate::error::ZeroError;
use crate::fsdp::{GradWire, WeightWire};
use crate::layout::{Layout, LayoutError};
use crate::measured::Measured;
use crate::qgz::FirstHop;

/// Every ZeRO++ switch, declared once: its name, doc, the type it has
/// once resolved, and how a config asks for it (`resolved as asked =
/// default`: an `Option` a config leaves unset is the mode's or the plan's
/// to choose). Calls `$callback! { ... }` with the list, so each form the
/// switches take is made from it: [`Switches`] here, `zeropp train`'s
/// settings and flags (`SwitchConfig`, `SwitchArgs`) in the application.
#[macro_export]
macro_rules! with_switches {
    ($callback:ident) => {
        $callback! {
            /// qwZ: bits of the forward weight gather (8 or 4; 0 = off);
            /// zeropp's default: 4 with qwz_delta, else 8.
            qwz_bits: Option<u32> as Option<u32> = None,
            /// hpZ: a node-local secondary shard of the weights for the
            /// backward gather, which then stays inside its group.
            hpz: bool as Option<bool> = None,
            /// Ranks sharing an hpZ secondary shard: consecutive local ranks
            /// of a node (a divisor of the ranks per node). Unset: the
            /// routing plan's choice — the node, or an NVLink island on a
            /// PCIe box.
            hpz_group: Option<usize> as Option<usize> = None,
            /// qgZ: the two-hop quantized gradient reduce-scatter (inside the
            /// node, then across), summed in f32.
            qgz: bool as Option<bool> = None,
            /// Error feedback for qgZ: what quantizing dropped is carried to
            /// the next step, on its int4 hops (an int8 first hop runs
            /// without). Default: on with qgZ.
            error_feedback: bool as Option<bool> = None,
            /// qgZ rounds gradients stochastically (unbiased) instead of to
            /// nearest.
            qgz_stochastic: bool as bool = false,
            /// Values per weight quantization block (qwZ; a power of two,
            /// 32..65536).
            block: usize as usize = 256,
            /// Values per gradient quantization block (qgZ): smaller than
            /// the weights' because gradients have heavier tails.
            qgz_block: usize as usize = 32,
            /// Bits of qgZ's first hop, inside the node (8 or 4, or 16: the
            /// gradient in bf16, not quantized; across nodes: 4). Default:
            /// the routing plan's — on nodes without GPUs 16 (quantizing
            /// costs the CPUs more than the bytes it saves there); with
            /// GPUs int8, unless the hop inside the node is about as slow
            /// per rank as the hop across.
            qgz_intra_bits: u32 as Option<u32> = None,
            /// Unquantized traffic (weights without qwZ, gradients without
            /// qgZ) in fp32 instead of bf16: exact data parallelism, for
            /// checking and for fast links.
            fp32_comm: bool as bool = false,
            /// qwZ sends weight differences across nodes (`zero::delta`):
            /// what each shard changed since the last gather, at qwz_bits,
            /// against a reference every receiver keeps; inside the node the
            /// plain wire (docs/TRAINING.md). zeropp's default: on with qwZ
            /// across nodes.
            qwz_delta: bool as Option<bool> = None,
            /// Forward gathers of a unit between full refreshes of its qwZ
            /// references (the weights themselves, in the plain wire), with
            /// qwz_delta.
            qwz_refresh: usize as usize = $crate::plan::DEFAULT_QWZ_REFRESH,
            /// qgZ's hop across nodes rotates each block by a Walsh–Hadamard
            /// matrix before quantizing (and back after summing), spreading
            /// outliers over their block. zeropp's default: on with qgZ.
            qgz_hadamard: bool as Option<bool> = None,
            /// Values per quantization block of qgZ's hop across nodes.
            /// Unset: 64 in zeropp mode, else qgz_block.
            qgz_inter_block: Option<usize> as Option<usize> = None,
            /// qwZ's references of weight differences kept in bf16 (with
            /// qwz_delta, behind the bf16 hop inside the node) instead of
            /// the default int8 blocks or f32: half f32's memory, for
            /// weights a little further from the master's (docs/TRAINING.md
            /// measures the loss).
            qwz_bf16_references: bool as bool = false,
            /// qwZ's references of weight differences (the frozen weights'
            /// cache, and hpZ's secondary shard) kept in host memory for
            /// device tensors, copied in and out as they are used: the
            /// device's memory stays at ZeRO-3's. The host path keeps them
            /// in host memory either way.
            qwz_host_references: bool as bool = false,
            /// qwZ's references of weight differences kept in int8 blocks
            /// of 64 values (with qwz_delta): about a quarter of f32's
            /// memory; the forward weights are those blocks, as ZeRO++'s
            /// int8 weights (docs/TRAINING.md measures the loss). A
            /// parameter group with frozen weights keeps its references in
            /// values, as without it. zeropp's default: on with qwz_delta,
            /// unless bf16 or host references or fp32_comm are asked for.
            qwz_int8_references: bool as Option<bool> = None,
        }
    };
}

/// [`Switches`] from [`with_switches!`]'s list.
macro_rules! resolved_switches {
    (
        $( $(#[doc = $doc:literal])* $field:ident : $resolved:ty as $asked:ty = $default:expr ),*
        $(,)?
    ) => {
        /// The ZeRO++ switches, each independent, as a job runs them
        /// (declared in [`with_switches!`]). A switch missing from what is
        /// read (an older summary or manifest) is ZeRO-3's.
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        #[serde(default)]
        pub struct Switches {
            $( $(#[doc = $doc])* pub $field: $resolved, )*
        }

        impl Switches {
            /// The switches' names, as `zeropp train`'s settings and flags,
            /// the JSON of a summary and `zeropp.torch.fully_shard`'s
            /// keywords spell them.
            pub const NAMES: &[&str] = &[$(stringify!($field)),*];
        }
    };
}
with_switches!(resolved_switches);

impl Default for Switches {
    fn default() -> Self {
        Switches::zero3(256)
    }
}

/// Values per int8 block of qwZ's references with `qwz_int8_references`:
/// with blocks of 256 the 8-seed sweep missed the loss targets (a small
/// weight's reference moves by its block's large weights' step),
/// with 64 it met them (docs/TRAINING.md, "int8 references").
pub const INT8_REFERENCE_BLOCK: usize = 64;

/// Forward gathers between qwZ delta refreshes, by default.
pub const DEFAULT_QWZ_REFRESH: usize = 100;

/// Values per block of qgZ's int4 hop across nodes, by default: larger
/// blocks lost final loss on the default model (docs/TRAINING.md has the
/// sweep).
pub const DEFAULT_QGZ_INTER_BLOCK: usize = 64;

impl Switches {
    /// ZeRO-3: plain bf16 gathers over the world, plain bf16 reduce-scatter.
    pub fn zero3(block: usize) -> Self {
        Switches {
            qwz_bits: None,
            hpz: false,
            hpz_group: None,
            qgz: false,
            error_feedback: false,
            qgz_stochastic: false,
            block,
            qgz_block: 32,
            qgz_intra_bits: 4,
            fp32_comm: false,
            qwz_delta: false,
            qwz_refresh: DEFAULT_QWZ_REFRESH,
            qgz_hadamard: false,
            qgz_inter_block: None,
            qwz_bf16_references: false,
            qwz_int8_references: false,
            qwz_host_references: false,
        }
    }

    /// zeropp's default: ZeRO++ (qwZ + hpZ + qgZ int4, round to nearest,
    /// error feedback) with what goes beyond it: qwZ sends int4 weight
    /// differences across nodes against references kept in int8 blocks,
    /// and qgZ's hop across nodes is rotated, in blocks of
    /// [`DEFAULT_QGZ_INTER_BLOCK`] (docs/TRAINING.md, "Beyond ZeRO++" and
    /// "int8 references"). Without the differences, qwZ is ZeRO++'s int8
    /// ([`resolve`]).
    pub fn zeropp(block: usize) -> Self {
        Switches {
            qwz_bits: Some(4),
            hpz: true,
            hpz_group: None,
            qgz: true,
            error_feedback: true,
            qgz_stochastic: false,
            block,
            qgz_block: 32,
            qgz_intra_bits: 4,
            fp32_comm: false,
            qwz_delta: true,
            qwz_refresh: DEFAULT_QWZ_REFRESH,
            qgz_hadamard: true,
            qgz_inter_block: Some(DEFAULT_QGZ_INTER_BLOCK),
            qwz_bf16_references: false,
            qwz_int8_references: true,
            qwz_host_references: false,
        }
    }

    /// What every caller does after applying overrides (`asked` names
    /// them), so `zeropp train` and `zeropp.torch` read them alike:
    /// `qwz_bits = 0` turns qwZ off, as None does; error feedback that was
    /// not asked for follows qgZ.
    pub fn settle_overrides(&mut self, asked: &[&str]) {
        if self.qwz_bits == Some(0) {
            self.qwz_bits = None;
        }
        if !asked.contains(&"error_feedback") {
            self.error_feedback = self.qgz;
        }
    }

    /// DeepSpeed's ZeRO++ as published: qwZ int8 on the weights
    /// themselves, hpZ, qgZ int4 with error feedback, no rotation.
    pub fn zeropp_published(block: usize) -> Self {
        Switches {
            qwz_bits: Some(8),
            qwz_delta: false,
            qgz_hadamard: false,
            qgz_inter_block: None,
            qwz_int8_references: false,
            ..Switches::zeropp(block)
        }
    }
}

/// The switches a job runs with, and where each value the plan chose came
/// from: what the engine, the summary, the metrics header, the checkpoint
/// manifest and the Python bindings all read.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Resolved {
    pub switches: Switches,
    /// Switch name → why it has its value: `"asked"`, or the routing plan's
    /// reason, or the fallback's.
    pub why: BTreeMap<String, String>,
}

/// Resolves the switches asked for (`asked` names those the user set)
/// against the routing plan, in the one place every caller uses: the hpZ
/// group is the asked one, else the plan's (the node, or an NVLink island)
/// when it divides the node, else the node; the bits of qgZ's first hop are
/// the asked ones, else the plan's, else int8 (the plan's choice when the
/// speed across is unknown). Checked the way the engine will use them.
///
/// With `measured` links and routes ([`crate::probe`]), each ZeRO++ switch
/// the user did not set is kept only where it pays on this job: qwZ where
/// its gather was at least 10% faster than the plain ring's at join, qgZ
/// likewise for the reduce-scatter, hpZ where there is a hop across nodes
/// to keep the backward gather off.
pub fn resolve(
    mut s: Switches,
    asked: &[&str],
    layout: Layout,
    routing: &Result<ClusterView, RoutingError>,
    measured: Option<&Measured>,
) -> Result<Resolved, PlanError> {
    let mut why = BTreeMap::new();
    for a in asked {
        why.insert(a.to_string(), "asked".to_string());
    }
    if let Some(m) = measured {
        choose_by_links(&mut s, asked, layout, m, &mut why);
    }
    let g = layout.ranks_per_node;
    if s.hpz && !asked.contains(&"hpz_group") {
        let (h, reason) = match routing {
            Ok(v) if v.plan.hpz_group >= 1 && g.is_multiple_of(v.plan.hpz_group) => (
                v.plan.hpz_group,
                format!("routing plan: {}", v.plan.hpz_why),
            ),
            Ok(v) => (
                g,
                format!(
                    "the node: the plan's group of {} does not divide {g} ranks",
                    v.plan.hpz_group
                ),
            ),
            Err(_) => (g, "the node: no routing plan".to_string()),
        };
        s.hpz_group = Some(h);
        why.insert("hpz_group".into(), reason);
    }
    if s.qgz && !asked.contains(&"qgz_intra_bits") {
        let (b, reason) = match routing {
            Ok(v) => (v.plan.qgz_bits[0], "routing plan"),
            Err(_) => (
                8,
                "no routing plan: int8 inside, cheap next to the hop across",
            ),
        };
        s.qgz_intra_bits = b;
        why.insert("qgz_intra_bits".into(), reason.to_string());
    }
    follow_what_was_kept(&mut s, asked, layout, &mut why);
    Plan::new(layout, &s)?;
    Ok(Resolved { switches: s, why })
}

/// The switches of `mode` (`"zeropp"`: qwZ + hpZ + qgZ, or `"zero3"`)
/// with `overrides` (switch names as `zeropp train` and `zeropp.torch`
/// spell them → values) applied, then resolved against the routing plan
/// and, for `"zeropp"`, what was `measured` at join, and checked ([`resolve`]):
/// what the Python bindings hand back.
pub fn resolve_mode(
    mode: &str,
    overrides: &serde_json::Map<String, serde_json::Value>,
    layout: Layout,
    routing: &Result<ClusterView, RoutingError>,
    measured: Option<&Measured>,
) -> Result<Resolved, PlanError> {
    let block = 256;
    let base = match mode {
        "zeropp" => Switches::zeropp(block),
        "zero3" => Switches::zero3(block),
        other => {
            return Err(PlanError::switch(
                "mode",
                format!(
                    "mode={other:?}: use \"zeropp\" (qwZ + hpZ + qgZ) or \"zero3\" (plain \
                     communication through zeropp's transports)"
                ),
            ));
        }
    };
    let serialized = |e: String| PlanError::switch("switches", e);
    let mut value = serde_json::to_value(&base).map_err(|e| serialized(e.to_string()))?;
    let obj = value
        .as_object_mut()
        .ok_or_else(|| serialized("the switches do not serialize to an object".into()))?;
    let defaults = obj.clone();
    for (k, v) in overrides {
        if !obj.contains_key(k) {
            let mut names: Vec<&String> = obj.keys().collect();
            names.sort();
            return Err(PlanError::switch(
                k.clone(),
                format!("unknown switch {k:?}; zeropp's switches are {names:?}"),
            ));
        }
        // Each value checked alone, so a wrong type names its switch.
        let mut alone = defaults.clone();
        alone.insert(k.clone(), v.clone());
        if let Err(e) = serde_json::from_value::<Switches>(alone.into()) {
            return Err(PlanError::switch(
                k.clone(),
                match &defaults[k] {
                    serde_json::Value::Null => {
                        format!("{k}={v}: {e} (unset, it is the routing plan's to choose)")
                    }
                    default => format!("{k}={v}: {e} (the switch's default: {default})"),
                },
            ));
        }
        obj.insert(k.clone(), v.clone());
    }
    let mut s: Switches = serde_json::from_value(value)
        .map_err(|e| serialized(format!("a switch has the wrong type: {e}")))?;
    let asked: Vec<&str> = overrides.keys().map(String::as_str).collect();
    s.settle_overrides(&asked);
    let measured = measured.filter(|_| mode == "zeropp");
    resolve(s, &asked, layout, routing, measured).map_err(|e| e.after("invalid switches: "))
}

/// The switches `zeropp train` (mode zeropp) resolves on `nodes` nodes
/// like `topo`, `g` ranks each, from their routing plan: the run's own
/// resolution, before the links it measures at join (which may change
/// them). What `zeropp topo plan` and `zeropp.routing_plan` report beside
/// the plan.
pub fn before_measuring(
    topo: &zeropp_topology::Topology,
    nodes: usize,
    g: usize,
) -> Result<Resolved, PlanError> {
    let routing = crate::routing::cluster(&vec![topo.clone(); nodes], g);
    let layout = Layout {
        nodes,
        ranks_per_node: g,
        rank: 0,
    };
    resolve_mode("zeropp", &Default::default(), layout, &routing, None)
}

/// `s` as it would run on `layout` before anything is measured, the
/// refinements followed ([`resolve`]): the formats the probe times.
pub fn as_they_would_run(mut s: Switches, asked: &[&str], layout: Layout) -> Switches {
    follow_what_was_kept(&mut s, asked, layout, &mut BTreeMap::new());
    s
}

/// The switches that refine another follow it where the user did not ask
/// for them: weight differences need qwZ and a hop across nodes; int4
/// weights go only as differences (otherwise ZeRO++'s int8); the rotation
/// needs qgZ; int8 references need weight differences and give way to the
/// other ways of keeping them (bf16, host memory), to fp32_comm and to an
/// hpZ group smaller than the node.
fn follow_what_was_kept(
    s: &mut Switches,
    asked: &[&str],
    layout: Layout,
    why: &mut BTreeMap<String, String>,
) {
    let not_asked = |name: &str| !asked.contains(&name);
    if s.qwz_delta && not_asked("qwz_delta") {
        let off = if s.qwz_bits.is_none() {
            Some("off: qwZ is off")
        } else if layout.nodes == 1 {
            Some("off: one node, no hop across nodes to send differences over")
        } else {
            None
        };
        if let Some(reason) = off {
            s.qwz_delta = false;
            why.insert("qwz_delta".into(), reason.into());
        }
    }
    if s.qwz_bits == Some(4) && !s.qwz_delta && not_asked("qwz_bits") {
        s.qwz_bits = Some(8);
        let reason = "int8: int4 weights go only as differences (qwz_delta)";
        why.entry("qwz_bits".into())
            .and_modify(|w| *w = format!("{w}; {reason}"))
            .or_insert_with(|| reason.into());
    }
    if s.qgz_hadamard && !s.qgz && not_asked("qgz_hadamard") {
        s.qgz_hadamard = false;
        why.insert("qgz_hadamard".into(), "off: qgZ is off".into());
    }
    if s.qwz_int8_references && not_asked("qwz_int8_references") {
        let off = if !s.qwz_delta {
            Some("off: no weight differences, no references to keep")
        } else if s.qwz_bf16_references {
            Some("off: qwz_bf16_references keeps them in bf16")
        } else if s.qwz_host_references {
            Some("off: qwz_host_references keeps them in host memory")
        } else if s.fp32_comm {
            Some("off: fp32_comm keeps them in f32")
        } else if s.hpz && s.hpz_group.is_some_and(|h| h < layout.ranks_per_node) {
            // Its secondary shard holds the forward's weights in bf16, which
            // int8 blocks' values are not: the backward would differ.
            Some("off: hpZ's group is smaller than the node, its secondary shard apart")
        } else {
            None
        };
        if let Some(reason) = off {
            s.qwz_int8_references = false;
            why.insert("qwz_int8_references".into(), reason.into());
        }
    }
}

/// What a quantized route must save to be chosen: at least this fraction
/// of the plain route's measured time.
const MUST_SAVE: f64 = 0.10;

/// [`resolve`]'s choice from the routes timed at join, for the switches
/// not asked.
fn choose_by_links(
    s: &mut Switches,
    asked: &[&str],
    layout: Layout,
    m: &Measured,
    why: &mut BTreeMap<String, String>,
) {
    let (r, links) = (&m.routes, &m.links);
    let ms = |x: f64| format!("{:.2} ms", x * 1e3);
    let rate = |l: Option<crate::measured::Link>| match l {
        Some(l) => format!("{:.0} MB/s", l.bytes_per_s / 1e6),
        None => "none".into(),
    };
    let measured = format!(
        "timed at join on a unit of {} values; links: across {} a rank, inside {}",
        r.values,
        rate(links.cross),
        rate(links.node),
    );
    // Whether the quantized route pays, and why, in the words of `why`.
    let choose = |route: &str, quantized: f64, plain: f64| {
        let keep = quantized < (1.0 - MUST_SAVE) * plain;
        let verdict = if keep { "quantized" } else { "plain" };
        let reason = format!(
            "{verdict}: {route} {} against plain {}; {measured}",
            ms(quantized),
            ms(plain)
        );
        (keep, reason)
    };
    // Asking for weight differences asks for qwZ.
    let qwz_asked = asked.contains(&"qwz_bits") || (asked.contains(&"qwz_delta") && s.qwz_delta);
    if !qwz_asked && s.qwz_bits.is_some() {
        let (keep, reason) = choose("qwZ gather", r.gather_qwz, r.gather_plain);
        if !keep {
            s.qwz_bits = None;
            s.qwz_delta = false;
        }
        why.insert("qwz_bits".into(), reason);
    }
    if !asked.contains(&"qgz") && !asked.contains(&"error_feedback") && s.qgz {
        let (keep, reason) = choose("qgZ reduce-scatter", r.reduce_qgz, r.reduce_plain);
        if !keep {
            s.qgz = false;
            s.error_feedback = false;
        }
        why.insert("qgz".into(), reason);
    }
    if layout.nodes == 1 && links.cross.is_some() {
        // A mesh dimension inside one node of a job that spans several
        // (HSDP's shard dimension): the routes were timed across nodes,
        // and inside a node quantizing saves nothing on a slow link. (On
        // one host the routes were timed inside it, and decide.)
        inside_one_node(s, asked, why);
    }
    if !asked.contains(&"hpz") && s.hpz && layout.nodes == 1 {
        s.hpz = false;
        why.insert(
            "hpz".into(),
            "off: one node, the backward gather never leaves it".into(),
        );
    }
}

/// The switches of a collective that never leaves one node of a job that
/// spans several (an island of one node, HSDP's shard dimension): qwZ,
/// qgZ and hpZ off where not asked — quantizing saves nothing there.
pub fn inside_one_node(s: &mut Switches, asked: &[&str], why: &mut BTreeMap<String, String>) {
    let qwz_asked = asked.contains(&"qwz_bits") || (asked.contains(&"qwz_delta") && s.qwz_delta);
    if !qwz_asked && s.qwz_bits.is_some() {
        s.qwz_bits = None;
        s.qwz_delta = false;
        why.insert(
            "qwz_bits".into(),
            "plain: one node, no hop across nodes".into(),
        );
    }
    if !asked.contains(&"qgz") && !asked.contains(&"error_feedback") && s.qgz {
        s.qgz = false;
        s.error_feedback = false;
        why.insert("qgz".into(), "plain: one node, no hop across nodes".into());
    }
    if !asked.contains(&"hpz") && s.hpz {
        s.hpz = false;
        why.insert(
            "hpz".into(),
            "off: one node, the backward gather never leaves it".into(),
        );
    }
}

/// Everything the engine needs to know about the switches.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub layout: Layout,
    pub weights: WeightWire,
    pub hpz: bool,
    /// Ranks sharing one hpZ secondary shard (divides the ranks per node).
    pub hpz_group: usize,
    pub grads: GradWire,
    /// Every unit's flat buffer is padded to a multiple of
    /// `world · granule`, so chunks are whole quantization blocks.
    pub granule: usize,
}

/// Why switches, a layout or a mesh make no plan: what is at fault (a
/// switch by its name, or the job's shape) and, in the message, what to do.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// A switch, or switches that do not go together (the one named).
    #[error("{}", named(switch, why))]
    Switch { switch: String, why: String },
    /// The job's shape: its ranks, nodes, islands or a mesh over them.
    #[error("{0}")]
    Layout(String),
}

/// `why`, with the switch it is about in front where it does not say so.
fn named(switch: &str, why: &str) -> String {
    if why.contains(switch) {
        why.to_string()
    } else {
        format!("{switch}: {why}")
    }
}

impl PlanError {
    fn switch(switch: impl Into<String>, why: impl Into<String>) -> PlanError {
        PlanError::Switch {
            switch: switch.into(),
            why: why.into(),
        }
    }

    fn layout(why: String) -> PlanError {
        PlanError::Layout(why)
    }

    /// The same error, its message after `context`.
    #[must_use]
    fn after(self, context: &str) -> PlanError {
        match self {
            PlanError::Switch { switch, why } => PlanError::Switch {
                why: format!("{context}{}", named(&switch, &why)),
                switch,
            },
            PlanError::Layout(why) => PlanError::Layout(format!("{context}{why}")),
        }
    }
}

impl From<LayoutError> for PlanError {
    fn from(e: LayoutError) -> PlanError {
        PlanError::Layout(e.0)
    }
}

/// A collective asked for a format or a group no plan allows.
impl From<PlanError> for ZeroError {
    fn from(e: PlanError) -> ZeroError {
        ZeroError::Invalid(e.to_string())
    }
}

/// qwZ's wire format: symmetric blocks of `block` values at `bits` (8 or
/// 4). The one place the engine and the bindings take it from.
pub fn weight_format(bits: u32, block: usize) -> Result<QuantFormat, PlanError> {
    if !matches!(bits, 8 | 4) {
        return Err(PlanError::switch(
            "qwz_bits",
            format!("qwZ supports 8 or 4 bits, not {bits}"),
        ));
    }
    let bits = Bits::from_u32(bits).map_err(|e| PlanError::switch("qwz_bits", e.to_string()))?;
    QuantFormat::new(bits, Scheme::Symmetric, block)
        .map_err(|e| PlanError::switch("block", e.to_string()))
}

/// qgZ's wire formats: the hop inside the node (`intra_bits`: 8 or 4, or
/// 16 for the gradient's own values in bf16) and the hop across nodes
/// (always int4), symmetric blocks of `block` values (`inter_block` across
/// nodes when given). The one place the engine and the bindings take them
/// from.
pub fn gradient_formats(
    intra_bits: u32,
    block: usize,
    inter_block: Option<usize>,
) -> Result<(FirstHop, QuantFormat), PlanError> {
    let intra_bits_error = |why: String| PlanError::switch("qgz_intra_bits", why);
    // The block is checked where it is not used too (the gradient in bf16
    // inside the node): a value asked that no hop could take is refused.
    QuantFormat::new(Bits::Eight, Scheme::Symmetric, block)
        .map_err(|e| PlanError::switch("qgz_block", e.to_string()))?;
    let intra = match intra_bits {
        16 => FirstHop::Bf16,
        8 | 4 => {
            let bits = Bits::from_u32(intra_bits).map_err(|e| intra_bits_error(e.to_string()))?;
            FirstHop::Quantized(
                QuantFormat::new(bits, Scheme::Symmetric, block)
                    .map_err(|e| PlanError::switch("qgz_block", e.to_string()))?,
            )
        }
        _ => {
            return Err(intra_bits_error(format!(
                "qgz_intra_bits={intra_bits}: qgZ's hop inside the node is int8 or int4, or 16 \
                 (the gradient in bf16, not quantized)"
            )));
        }
    };
    let inter = QuantFormat::int4(inter_block.unwrap_or(block))
        .map_err(|e| PlanError::switch("qgz_inter_block", e.to_string()))?;
    Ok((intra, inter))
}

/// How a unit's weights cross nodes under `s` (`hpz_over_node`: hpZ's group
/// is the whole node, so qwZ's references serve the backward gather).
fn weight_wire(s: &Switches, hpz_over_node: bool) -> Result<WeightWire, PlanError> {
    Ok(match s.qwz_bits {
        None if s.qwz_delta => {
            return Err(PlanError::switch(
                "qwz_delta",
                "qwz_delta sends qwZ's weight differences: set qwz_bits (4 or 8) for their \
                 bits, or turn qwz_delta off",
            ));
        }
        None if s.fp32_comm => WeightWire::F32,
        None => WeightWire::Bf16,
        _ if !s.qwz_delta
            && (s.qwz_bf16_references || s.qwz_host_references || s.qwz_int8_references) =>
        {
            let switch = match (s.qwz_bf16_references, s.qwz_int8_references) {
                (true, _) => "qwz_bf16_references",
                (_, true) => "qwz_int8_references",
                _ => "qwz_host_references",
            };
            return Err(PlanError::switch(
                switch,
                format!(
                    "{switch} keeps qwZ's references of weight differences: turn qwz_delta on \
                     (with qwz_bits), or it off"
                ),
            ));
        }
        _ if s.qwz_int8_references && (s.qwz_bf16_references || s.qwz_host_references) => {
            return Err(PlanError::switch(
                "qwz_int8_references",
                "qwz_int8_references keeps qwZ's references in int8 blocks, in the device's \
                 memory: turn qwz_bf16_references and qwz_host_references off, or it off",
            ));
        }
        _ if s.qwz_bf16_references && s.fp32_comm => {
            return Err(PlanError::switch(
                "qwz_bf16_references",
                "qwz_bf16_references keeps the references as the bf16 hop inside the node \
                 moves them: turn fp32_comm off, or it off",
            ));
        }
        Some(b) if s.qwz_delta => {
            if s.qwz_refresh == 0 {
                return Err(PlanError::switch(
                    "qwz_refresh",
                    "qwz_refresh=0: refresh the references every 1 or more forward gathers",
                ));
            }
            WeightWire::Delta(crate::delta::DeltaWire {
                delta: weight_format(b, s.block)?,
                refresh_every: s.qwz_refresh as u64,
                fp32: s.fp32_comm,
                // hpZ over the whole node: the references are its
                // secondary shard.
                hpz: hpz_over_node,
                bf16_references: s.qwz_bf16_references,
                int8_references: match s.qwz_int8_references {
                    true => Some(weight_format(8, INT8_REFERENCE_BLOCK)?),
                    false => None,
                },
            })
        }
        Some(b) => WeightWire::Quantized(weight_format(b, s.block)?),
    })
}

/// How gradients are reduced under `s`.
fn grad_wire(s: &Switches) -> Result<GradWire, PlanError> {
    Ok(if s.qgz {
        let (intra, inter) = gradient_formats(s.qgz_intra_bits, s.qgz_block, s.qgz_inter_block)?;
        GradWire::TwoHop {
            intra,
            inter,
            error_feedback: s.error_feedback,
            stochastic: s.qgz_stochastic,
            hadamard: s.qgz_hadamard,
        }
    } else {
        if s.qgz_hadamard {
            return Err(PlanError::switch(
                "qgz_hadamard",
                "qgz_hadamard rotates qgZ's hop across nodes: turn qgz on",
            ));
        }
        if s.error_feedback {
            return Err(PlanError::switch(
                "error_feedback",
                "error feedback needs qgZ (it corrects the quantized gradient)",
            ));
        }
        if s.fp32_comm {
            GradWire::RingF32
        } else {
            GradWire::RingBf16
        }
    })
}

impl Plan {
    pub fn new(layout: Layout, s: &Switches) -> Result<Plan, PlanError> {
        if layout.world() == 0 || layout.rank >= layout.world() {
            return Err(PlanError::layout(format!(
                "rank {} is outside {} nodes x {} ranks",
                layout.rank, layout.nodes, layout.ranks_per_node
            )));
        }
        let g = layout.ranks_per_node;
        let hpz_group = s.hpz_group.unwrap_or(g);
        if hpz_group == 0 || !g.is_multiple_of(hpz_group) {
            return Err(PlanError::switch(
                "hpz_group",
                format!(
                    "an hpZ group of {hpz_group} ranks does not divide the {g} ranks of a \
                     node: use a divisor of {g}"
                ),
            ));
        }
        let weights = weight_wire(s, s.hpz && hpz_group == g)?;
        let grads = grad_wire(s)?;
        Ok(Plan {
            layout,
            weights,
            hpz: s.hpz,
            hpz_group,
            grads,
            // Both block sizes are powers of two: the larger is a multiple
            // of the smaller, so chunks are whole blocks of each.
            granule: s
                .block
                .max(s.qgz_block)
                .max(s.qgz_inter_block.unwrap_or(0))
                .max(zeropp_quant::MIN_BLOCK),
        })
    }

    /// Padded length of a unit of `numel` parameters.
    pub fn padded_len(&self, numel: usize) -> usize {
        let quantum = self.layout.world() * self.granule;
        numel.div_ceil(quantum).max(1) * quantum
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zeropp_topology::Topology;

    fn layout() -> Layout {
        Layout {
            nodes: 2,
            ranks_per_node: 4,
            rank: 0,
        }
    }

    /// The routing plan of two GPU-less hosts of 4 ranks.
    fn routing() -> Result<ClusterView, RoutingError> {
        let host = |h: &str| Topology {
            hostname: h.into(),
            numa_nodes: vec![],
            gpus: vec![],
            gpu_links: vec![],
            nics: vec![],
        };
        crate::routing::cluster(&[host("a"), host("b")], 4)
    }

    /// What a job measured: routes of these times (ms), links unknown.
    fn measured(gather: (f64, f64), reduce: (f64, f64)) -> Measured {
        Measured {
            links: crate::measured::Links {
                node: None,
                cross: None,
                quantize_per_s: 1e9,
                dequantize_per_s: 2e9,
                seconds: 0.5,
            },
            routes: crate::measured::Routes {
                values: 1 << 20,
                gather_plain: gather.0 / 1e3,
                gather_qwz: gather.1 / 1e3,
                reduce_plain: reduce.0 / 1e3,
                reduce_qgz: reduce.1 / 1e3,
                seconds: 0.2,
            },
        }
    }

    #[test]
    fn measured_routes_keep_quantization_only_where_it_pays() {
        let two = layout();
        let one = Layout {
            nodes: 1,
            ranks_per_node: 4,
            rank: 0,
        };
        let zpp = || Switches::zeropp(256);
        // One node where quantizing costs more than it saves: ZeRO-3's plan.
        let m = measured((2.0, 2.5), (3.0, 2.9));
        let r = resolve(zpp(), &[], one, &routing(), Some(&m)).unwrap();
        assert_eq!(
            (
                r.switches.qwz_bits,
                r.switches.qgz,
                r.switches.hpz,
                r.switches.error_feedback
            ),
            (None, false, false, false),
            "{r:?}"
        );
        assert!(r.why["qwz_bits"].starts_with("plain: qwZ gather 2.50 ms against plain 2.00 ms"));
        assert!(r.why["qgz"].starts_with("plain: "), "{r:?}");
        assert!(r.why["hpz"].contains("one node"), "{r:?}");
        // A slow hop across: zeropp's default throughout.
        let m = measured((200.0, 60.0), (210.0, 50.0));
        let r = resolve(zpp(), &[], two, &routing(), Some(&m)).unwrap();
        assert_eq!(
            r.switches,
            Switches {
                hpz_group: r.switches.hpz_group,
                qgz_intra_bits: r.switches.qgz_intra_bits,
                ..zpp()
            }
        );
        assert!(r.why["qgz"].starts_with("quantized: "), "{r:?}");
        // What the user asked for stays, whatever was measured.
        let m = measured((2.0, 2.5), (3.0, 2.9));
        let r = resolve(zpp(), &["qwz_bits", "qgz"], two, &routing(), Some(&m)).unwrap();
        assert_eq!(
            (r.switches.qwz_bits, r.switches.qgz),
            (Some(4), true),
            "{r:?}"
        );
        assert_eq!(r.why["qgz"], "asked");
        // zero3 takes nothing from the measurement.
        let r = resolve_mode("zero3", &Default::default(), two, &routing(), Some(&m)).unwrap();
        assert_eq!(r.switches, Switches::zero3(256));
    }

    #[test]
    fn refinements_follow_the_switch_they_refine_unless_asked() {
        let json = |s: &str| serde_json::from_str(s).unwrap();
        let get = |o: &str, layout: Layout| {
            resolve_mode("zeropp", &json(o), layout, &routing(), None).map(|r| {
                let s = &r.switches;
                ((s.qwz_bits, s.qwz_delta, s.qgz_hadamard), r.why)
            })
        };
        let two = layout();
        let one = Layout {
            nodes: 1,
            ..layout()
        };
        // The default across nodes: int4 differences, a rotated hop.
        assert_eq!(get("{}", two).unwrap().0, (Some(4), true, true));
        // Without differences (asked, or one node), qwZ is ZeRO++'s int8.
        let (s, why) = get(r#"{"qwz_delta": false}"#, two).unwrap();
        assert_eq!(s, (Some(8), false, true));
        assert!(why["qwz_bits"].contains("int4 weights go only as differences"));
        let (s, why) = get("{}", one).unwrap();
        assert_eq!(s, (Some(8), false, true));
        assert!(why["qwz_delta"].contains("one node"), "{why:?}");
        // Asked int4 stays int4; qwZ off takes the differences with it.
        assert_eq!(
            get(r#"{"qwz_delta": false, "qwz_bits": 4}"#, two)
                .unwrap()
                .0,
            (Some(4), false, true)
        );
        let (s, why) = get(r#"{"qwz_bits": null}"#, two).unwrap();
        assert_eq!(s, (None, false, true));
        assert_eq!(why["qwz_delta"], "off: qwZ is off");
        // qgZ off takes the rotation with it, unless it was asked.
        let (s, why) = get(r#"{"qgz": false, "error_feedback": false}"#, two).unwrap();
        assert_eq!(s, (Some(4), true, false));
        assert_eq!(why["qgz_hadamard"], "off: qgZ is off");
        let e = get(
            r#"{"qgz": false, "error_feedback": false, "qgz_hadamard": true}"#,
            two,
        )
        .unwrap_err();
        assert!(
            matches!(&e, PlanError::Switch { switch, .. } if switch == "qgz_hadamard"),
            "{e}"
        );
        let e = e.to_string();
        assert!(e.contains("turn qgz on"), "{e}");
        let e = get(r#"{"qwz_bits": null, "qwz_delta": true}"#, two)
            .unwrap_err()
            .to_string();
        assert!(e.contains("set qwz_bits"), "{e}");
        // DeepSpeed's ZeRO++ as published is one override away.
        let r = resolve_mode(
            "zeropp",
            &json(r#"{"qwz_delta": false, "qgz_hadamard": false, "qgz_inter_block": null}"#),
            two,
            &routing(),
            None,
        )
        .unwrap();
        assert_eq!(
            r.switches,
            Switches {
                hpz_group: r.switches.hpz_group,
                qgz_intra_bits: r.switches.qgz_intra_bits,
                ..Switches::zeropp_published(256)
            }
        );
    }

    #[test]
    fn int8_references_are_the_default_where_there_are_references_to_keep_in_them() {
        let json = |s: &str| serde_json::from_str(s).unwrap();
        let get = |o: &str| {
            resolve_mode("zeropp", &json(o), layout(), &routing(), None)
                .map(|r| (r.switches.qwz_int8_references, r.why))
        };
        assert!(get("{}").unwrap().0);
        // The other ways of keeping them, f32 on the wire, no differences
        // or an hpZ group apart from the node turn them off unless asked.
        for (o, reason) in [
            (r#"{"qwz_bf16_references": true}"#, "in bf16"),
            (r#"{"qwz_host_references": true}"#, "in host memory"),
            (r#"{"fp32_comm": true}"#, "fp32_comm"),
            (r#"{"qwz_delta": false}"#, "no weight differences"),
            (r#"{"qwz_bits": null}"#, "no weight differences"),
            (r#"{"hpz_group": 1}"#, "smaller than the node"),
        ] {
            let (on, why) = get(o).unwrap();
            assert!(!on, "{o}");
            assert!(why["qwz_int8_references"].contains(reason), "{o}: {why:?}");
        }
        assert!(!get(r#"{"qwz_int8_references": false}"#).unwrap().0);
        // Asked beside another way of keeping them: the switch error.
        let asked = r#"{"qwz_int8_references": true, "qwz_bf16_references": true}"#;
        let e = get(asked).unwrap_err().to_string();
        assert!(e.contains("turn qwz_bf16_references and"), "{e}");
        // ZeRO-3 keeps no references.
        let r = resolve_mode("zero3", &json("{}"), layout(), &routing(), None).unwrap();
        assert!(!r.switches.qwz_int8_references);
    }

    #[test]
    fn the_plan_fills_what_was_not_asked_and_says_why() {
        let view = routing().unwrap();
        let r = resolve(Switches::zeropp(256), &[], layout(), &routing(), None).unwrap();
        assert_eq!(r.switches.hpz_group, Some(view.plan.hpz_group));
        assert_eq!(r.switches.qgz_intra_bits, view.plan.qgz_bits[0]);
        assert!(r.why["hpz_group"].starts_with("routing plan: "), "{r:?}");
        assert_eq!(r.why["qgz_intra_bits"], "routing plan");
        // What ran is written as a JSON object with these names.
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(j["switches"]["hpz_group"], view.plan.hpz_group);
    }

    #[test]
    fn inside_one_node_measured_links_keep_the_collectives_plain() {
        use crate::measured::{Link, Links, Measured, Routes};
        let slow = Link {
            bytes_per_s: 4e6,
            latency_s: 1e-4,
        };
        // Timed across nodes, where quantizing paid.
        let m = Measured {
            links: Links {
                node: Some(slow),
                cross: Some(slow),
                quantize_per_s: 1e9,
                dequantize_per_s: 1e9,
                seconds: 0.1,
            },
            routes: Routes {
                values: 1 << 16,
                gather_plain: 0.04,
                gather_qwz: 0.01,
                reduce_plain: 0.04,
                reduce_qgz: 0.01,
                seconds: 0.1,
            },
        };
        let resolve_on = |l: Layout| {
            resolve_mode("zeropp", &Default::default(), l, &routing(), Some(&m)).unwrap()
        };
        let across = resolve_on(layout()).switches;
        assert!(
            across.qwz_bits.is_some() && across.qgz && across.hpz,
            "{across:?}"
        );
        let inside = resolve_on(Layout {
            nodes: 1,
            ..layout()
        });
        let s = inside.switches;
        assert!(s.qwz_bits.is_none() && !s.qgz && !s.hpz, "{s:?}");
        assert!(inside.why["qgz"].contains("one node"), "{:?}", inside.why);
    }

    #[test]
    fn qwz_bits_0_is_off_and_error_feedback_follows_qgz_unless_asked() {
        let run = |mode: &str, o: &str| {
            let json = serde_json::from_str(o).unwrap();
            resolve_mode(mode, &json, layout(), &routing(), None)
                .unwrap()
                .switches
        };
        assert_eq!(run("zeropp", r#"{"qwz_bits": 0}"#).qwz_bits, None);
        assert!(run("zero3", r#"{"qgz": true}"#).error_feedback);
        assert!(!run("zeropp", r#"{"qgz": false}"#).error_feedback);
        let asked = run("zeropp", r#"{"error_feedback": false}"#);
        assert!(asked.qgz && !asked.error_feedback);
    }

    #[test]
    fn a_mode_with_overrides_resolves_or_names_what_is_wrong() {
        let json = |s: &str| serde_json::from_str(s).unwrap();
        let r = resolve_mode(
            "zeropp",
            &json(r#"{"qwz_bits": 4}"#),
            layout(),
            &routing(),
            None,
        )
        .unwrap();
        assert_eq!(r.switches.qwz_bits, Some(4));
        assert_eq!(r.why["qwz_bits"], "asked");
        let r = resolve_mode("zero3", &json("{}"), layout(), &routing(), None).unwrap();
        assert_eq!(r.switches, Switches::zero3(256));
        let err = |mode: &str, o: &str| resolve_mode(mode, &json(o), layout(), &routing(), None);
        let e = err("zero4", "{}").unwrap_err().to_string();
        assert!(e.contains("use \"zeropp\""), "{e}");
        let e = err("zeropp", r#"{"qwz": 8}"#).unwrap_err();
        assert!(
            matches!(&e, PlanError::Switch { switch, .. } if switch == "qwz"),
            "{e}"
        );
        let e = e.to_string();
        assert!(
            e.contains("unknown switch \"qwz\"") && e.contains("qwz_bits"),
            "{e}"
        );
        // A wrong type names its switch, what was given and the default.
        let e = err("zeropp", r#"{"hpz": "yes"}"#).unwrap_err().to_string();
        assert!(
            e.contains("hpz=\"yes\"") && e.contains("default: true"),
            "{e}"
        );
        let e = err("zeropp", r#"{"qwz_refresh": -5}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("qwz_refresh=-5"), "{e}");
        let e = err("zeropp", r#"{"qwz_bits": 3}"#).unwrap_err();
        assert!(
            matches!(&e, PlanError::Switch { switch, .. } if switch == "qwz_bits"),
            "{e}"
        );
        let e = e.to_string();
        assert!(
            e.contains("invalid switches: qwz_bits: qwZ supports 8 or 4 bits"),
            "{e}"
        );
        // References kept in bf16 or in host memory need references.
        for switch in [
            "qwz_bf16_references",
            "qwz_host_references",
            "qwz_int8_references",
        ] {
            let asked = format!(r#"{{"qwz_delta": false, "{switch}": true}}"#);
            let e = err("zeropp", &asked).unwrap_err();
            assert!(
                matches!(&e, PlanError::Switch { switch: s, .. } if s == switch),
                "{e}"
            );
            let e = e.to_string();
            assert!(e.contains(switch) && e.contains("turn qwz_delta on"), "{e}");
            let asked = format!(r#"{{"{switch}": true}}"#);
            assert!(err("zeropp", &asked).is_ok(), "{switch} with the default");
        }
    }

    #[test]
    fn wire_formats_come_from_one_place_and_refuse_other_bits() {
        assert_eq!(
            weight_format(4, 256).unwrap(),
            QuantFormat::int4(256).unwrap()
        );
        let (intra, inter) = gradient_formats(8, 32, None).unwrap();
        assert_eq!(
            (intra, inter),
            (
                FirstHop::Quantized(QuantFormat::int8(32).unwrap()),
                QuantFormat::int4(32).unwrap()
            )
        );
        assert_eq!(gradient_formats(16, 32, None).unwrap().0, FirstHop::Bf16);
        // A block no hop could take is refused where it goes unused too.
        for block in [0, 7] {
            let e = gradient_formats(16, block, Some(64))
                .unwrap_err()
                .to_string();
            assert!(e.contains("qgz_block"), "{e}");
        }
        let e = weight_format(2, 256).unwrap_err().to_string();
        assert!(e.contains("8 or 4 bits, not 2"), "{e}");
        let e = gradient_formats(2, 32, None).unwrap_err().to_string();
        assert!(e.contains("int8 or int4"), "{e}");
        let mut s = Switches::zeropp(256);
        s.qgz_intra_bits = 2;
        assert!(
            Plan::new(layout(), &s)
                .unwrap_err()
                .to_string()
                .contains("int8 or int4")
        );
    }

    #[test]
    fn asked_values_win_and_fallbacks_apply_without_a_plan() {
        let mut s = Switches::zeropp(256);
        s.hpz_group = Some(2);
        s.qgz_intra_bits = 4;
        let r = resolve(
            s,
            &["hpz_group", "qgz_intra_bits"],
            layout(),
            &routing(),
            None,
        )
        .unwrap();
        assert_eq!(
            (r.switches.hpz_group, r.switches.qgz_intra_bits),
            (Some(2), 4)
        );
        assert_eq!(r.why["hpz_group"], "asked");
        let none = Err(RoutingError::Unpublished);
        let r = resolve(Switches::zeropp(256), &[], layout(), &none, None).unwrap();
        assert_eq!(
            (r.switches.hpz_group, r.switches.qgz_intra_bits),
            (Some(4), 8)
        );
        // Off switches resolve nothing; a group that does not divide the
        // node is refused with the remedy.
        let r = resolve(Switches::zero3(256), &[], layout(), &routing(), None).unwrap();
        assert_eq!(r.switches.hpz_group, None);
        assert!(r.why.is_empty());
        let mut s = Switches::zeropp(256);
        s.hpz_group = Some(3);
        let e = resolve(s, &["hpz_group"], layout(), &routing(), None).unwrap_err();
        assert!(
            matches!(&e, PlanError::Switch { switch, .. } if switch == "hpz_group"),
            "{e}"
        );
        assert!(e.to_string().contains("use a divisor of 4"), "{e}");
    }
}
