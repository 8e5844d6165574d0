//! FSDP2's two collectives on one parameter group — the all-gather of its
//! shards and the reduce-scatter of its gradient — as zeropp runs them,
//! written once over a [`Quantizer`] and a [`ByteMover`]. `zeropp.torch`'s
//! host path, its emulated device and its CUDA path all call these; only
//! the backend differs.

use zeropp_cuda::GpuElement;
use zeropp_quant::{QuantFormat, Rounding};

use crate::backend::{ByteMover, Hop, Quantizer};
use crate::delta::{self, DeltaWire, Slot};
use crate::error::ZeroError;
use crate::layout::Layout;
use crate::qgz::{self, FirstHop, Reduction};
use crate::traffic::Phase;
use crate::{hpz, qwz};

/// How weights travel in a gather: the plan's choice for a parameter group
/// (`plan::Plan::weights`), and, made for one call by
/// [`WeightWire::for_call`], how that call moves its tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum WeightWire {
    /// Plain, bf16 on the wire: a wider tensor (the engine's f32 masters)
    /// rounded to nearest even and widened back on arrival; a bf16 tensor
    /// as it is.
    Bf16,
    /// Plain, unrounded: the tensor's own bytes (f32 masters in f32).
    F32,
    /// qwZ: the shard quantized in this format, gathered across nodes then
    /// inside each.
    Quantized(QuantFormat),
    /// qwZ on weight differences against references the caller keeps.
    Delta(DeltaWire),
}

impl WeightWire {
    /// Whether the unquantized parts of this wire travel in f32.
    pub fn fp32(&self) -> bool {
        match self {
            WeightWire::F32 => true,
            WeightWire::Delta(d) => d.fp32,
            WeightWire::Bf16 | WeightWire::Quantized(_) => false,
        }
    }

    /// How FSDP2's gather ([`all_gather`]) of a parameter group whose plan
    /// moves weights on this wire moves one call's tensor: over the world
    /// (`over_world`) or a sub-group, of bf16 tensors (`bf16`) or others.
    /// qwZ runs over the world only: a sub-group moves the bytes as they
    /// are, and so do the plain wires (the tensor's own dtype is FSDP2's).
    /// Differences cross nodes in this wire's format; the hop inside the
    /// node moves what plain FSDP2 would move for these tensors (bf16 ones
    /// in bf16 unless the wire says f32, others in f32).
    pub fn for_call(self, over_world: bool, bf16: bool) -> WeightWire {
        let own = if bf16 {
            WeightWire::Bf16
        } else {
            WeightWire::F32
        };
        match self {
            _ if !over_world => own,
            WeightWire::Bf16 | WeightWire::F32 => own,
            WeightWire::Quantized(format) => WeightWire::Quantized(format),
            WeightWire::Delta(d) => WeightWire::Delta(DeltaWire {
                fp32: d.fp32 || !bf16,
                ..d
            }),
        }
    }

    /// Whether a gather on this wire moves the bytes as they are (or
    /// rounded to bf16): ZeRO-3's, and hpZ's backward gather inside its
    /// group.
    pub fn plain(&self) -> bool {
        matches!(self, WeightWire::Bf16 | WeightWire::F32)
    }
}

/// FSDP2's all-gather over `hop` (the world, or the hpZ group for a
/// sub-group's gather): `shard` (this rank's) into `out` (every member's,
/// in member order), moved on `wire` and counted under `phase`. `slot`
/// holds the references of [`WeightWire::Delta`] and the group's frozen
/// ranges (required there, unused otherwise).
#[allow(clippy::too_many_arguments)]
pub fn all_gather<Q: Quantizer, M: ByteMover<Q>, T: GpuElement>(
    q: &Q,
    m: &M,
    layout: Layout,
    hop: Hop,
    wire: WeightWire,
    phase: Phase,
    slot: Option<Slot<'_, Q::Kept, Q::Chunks>>,
    shard: &Q::Tensor<'_, T>,
    out: &mut Q::TensorMut<'_, T>,
) -> Result<(), ZeroError> {
    let ready = (Prepared::none(), shard);
    all_gather_prepared(q, m, layout, (hop, phase), wire, slot, ready, None, out).map(|_| ())
}

/// A gather's shard as the caller's thread made it ready
/// ([`prepare_gather`]): qwZ's quantized there, while the communication
/// thread moves the last call's; on every other wire nothing is done
/// ahead.
pub struct Prepared<Q: Quantizer>(Option<Q::Chunks>);

impl<Q: Quantizer> Prepared<Q> {
    /// Nothing made ready: the gather quantizes (if it does) itself.
    pub fn none() -> Prepared<Q> {
        Prepared(None)
    }
}

/// What a gather of `shard` on `wire` can do before it is its turn to
/// move: qwZ quantizes the shard (round to nearest,
/// [`qwz::quantize_shard`]).
pub fn prepare_gather<Q: Quantizer, T: GpuElement>(
    q: &Q,
    wire: WeightWire,
    shard: &Q::Tensor<'_, T>,
) -> Result<Prepared<Q>, ZeroError> {
    match wire {
        WeightWire::Quantized(format) => Ok(Prepared(Some(qwz::quantize_shard(q, shard, format)?))),
        _ => Ok(Prepared::none()),
    }
}

/// [`all_gather`] of a shard made ready by [`prepare_gather`]. With
/// `keep` (an hpZ group's size), a qwZ gather also gives this rank's
/// secondary shard of the chunks as they came, still quantized
/// ([`hpz::Secondary::of_quantized`]); on the other wires what arrives is
/// `out` itself, which the caller keeps from ([`hpz::Secondary::of_values`]).
#[allow(clippy::too_many_arguments)]
pub fn all_gather_prepared<Q: Quantizer, M: ByteMover<Q>, T: GpuElement>(
    q: &Q,
    m: &M,
    layout: Layout,
    (hop, phase): (Hop, Phase),
    wire: WeightWire,
    slot: Option<Slot<'_, Q::Kept, Q::Chunks>>,
    (prepared, shard): (Prepared<Q>, &Q::Tensor<'_, T>),
    keep: Option<usize>,
    out: &mut Q::TensorMut<'_, T>,
) -> Result<Option<hpz::Secondary<Q>>, ZeroError> {
    if q.tensor_len(shard) == 0 {
        return Ok(None);
    }
    if !wire.plain() && m.size(hop) != layout.world() {
        return Err(ZeroError::Invalid(format!(
            "qwZ gathers over the world ({} ranks), not over a group of {}",
            layout.world(),
            m.size(hop)
        )));
    }
    match wire {
        WeightWire::Bf16 if T::TAG != "bf16" => m.all_gather_tensor_bf16(q, hop, phase, shard, out),
        WeightWire::Bf16 | WeightWire::F32 => m.all_gather_tensor(q, hop, phase, shard, out),
        WeightWire::Quantized(format) => {
            let all = match prepared.0 {
                Some(mine) => {
                    let all = qwz::gather_chunks(q, m, layout, &mine, phase)?;
                    q.recycle_chunks(mine);
                    all
                }
                None => qwz::gather_quantized(q, m, layout, shard, format, phase)?,
            };
            let secondary = keep
                .map(|h| hpz::Secondary::of_quantized(q, layout, h, &all))
                .transpose()?;
            qwz::dequantize_all(q, &all, |r| qwz::gathered_position(layout, r), out)?;
            q.recycle_chunks(all);
            return Ok(secondary);
        }
        WeightWire::Delta(wire) => {
            let slot = slot.ok_or_else(|| {
                ZeroError::Invalid("qwZ on weight differences needs the group's references".into())
            })?;
            delta::gather(q, m, layout, wire, slot, shard, out, phase)
        }
    }?;
    Ok(None)
}

/// How gradients are reduce-scattered: the plan's choice for a parameter
/// group (`plan::Plan::grads`), and, made for one call's tensor by
/// [`GradWire::for_call`], how FSDP2's reduce-scatter sums it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GradWire {
    /// A ring over the world in bf16 (f32 sums at each step, each rounded
    /// to bf16): bf16 tensors. The engine narrows its f32 gradients itself
    /// and keeps the mean in f32.
    RingBf16,
    /// A ring over the world, unrounded: the tensor's own dtype (f32
    /// gradients in f32).
    RingF32,
    /// qgZ: swizzled quantized (or bf16) all-to-all inside the node, f32
    /// sum, requantize, all-to-all across nodes, f32 sum, divide by W.
    TwoHop {
        /// The first hop (inside the node).
        intra: FirstHop,
        /// Format of the second hop (across nodes).
        inter: QuantFormat,
        error_feedback: bool,
        stochastic: bool,
        /// The hop across nodes rotated block by block (Walsh–Hadamard).
        hadamard: bool,
    },
}

impl GradWire {
    /// How a call of bf16 tensors (`bf16`) or others is reduce-scattered
    /// on this wire: a ring sums in the tensor's own dtype, as FSDP2's
    /// does; qgZ as the plan says.
    pub fn for_call(self, bf16: bool) -> GradWire {
        match self {
            GradWire::RingBf16 | GradWire::RingF32 if bf16 => GradWire::RingBf16,
            GradWire::RingBf16 | GradWire::RingF32 => GradWire::RingF32,
            two_hop => two_hop,
        }
    }

    /// Whether each of qgZ's hops keeps error feedback on nodes of
    /// `ranks_per_node` ranks: (inside the node, across); a ring keeps
    /// none, nor a node of one rank inside it
    /// ([`qgz::first_hop_feedback`]).
    pub fn keeps(&self, ranks_per_node: usize) -> (bool, bool) {
        match *self {
            GradWire::TwoHop {
                intra,
                error_feedback,
                ..
            } => (
                qgz::first_hop_feedback(error_feedback, intra, ranks_per_node),
                error_feedback,
            ),
            GradWire::RingBf16 | GradWire::RingF32 => (false, false),
        }
    }

    /// qgZ's settings for one call rounding as `rounding` (None for a
    /// ring).
    pub fn qgz(&self, rounding: Rounding) -> Option<qgz::Qgz> {
        match *self {
            GradWire::TwoHop {
                intra,
                inter,
                hadamard,
                ..
            } => Some(qgz::Qgz {
                intra,
                inter,
                rounding,
                hadamard,
            }),
            GradWire::RingBf16 | GradWire::RingF32 => None,
        }
    }
}

/// FSDP2's reduce-scatter over the world: `grad` (W equal chunks, rank
/// order) summed or averaged over every rank as `reduction` says, this
/// rank's chunk into `out` (counted as the gradient phase), on `wire`. qgZ
/// rounds as `rounding` says, adds and keeps `feedback`'s residuals, widens
/// the gradient to f32, sums in f32 and rounds the result to `T` once; a
/// ring has no use for either.
#[allow(clippy::too_many_arguments)]
pub fn reduce_scatter<Q: Quantizer, M: ByteMover<Q>, T: GpuElement>(
    q: &Q,
    m: &M,
    layout: Layout,
    wire: GradWire,
    (rounding, feedback): (Rounding, qgz::Feedback<'_, Q>),
    reduction: Reduction,
    grad: &Q::Tensor<'_, T>,
    out: &mut Q::TensorMut<'_, T>,
) -> Result<(), ZeroError> {
    let len = q.tensor_len(grad);
    if len == 0 {
        return Ok(());
    }
    match wire.qgz(rounding) {
        None if wire == GradWire::RingBf16 && T::TAG != "bf16" => Err(ZeroError::Invalid(format!(
            "a bf16 ring reduce-scatters bf16 tensors, not {}: take the call's wire from \
             GradWire::for_call",
            T::TAG
        ))),
        None => {
            let mean = reduction == Reduction::Mean;
            m.reduce_scatter_tensor(q, Hop::World, Phase::Gradient, grad, out, mean)
        }
        Some(s) => {
            let sum = qgz::reduce_scatter_tensor(q, m, layout, (s, reduction), grad, feedback)?;
            q.store_values(&sum, 0, out, 0, q.len(&sum))?;
            q.recycle(sum);
            Ok(())
        }
    }
}

/// A gradient as the caller's thread made it ready for its reduce-scatter
/// ([`prepare_gradient`]), taken by the call: qgZ's first hop quantized
/// there, with its error feedback added, or rounded to bf16 in runs for a
/// bf16 hop inside the node, or a bf16 ring's values rounded to bf16,
/// while the communication thread moves the last call's; on every other
/// wire the f32 values as they are.
pub struct Gradient<Q: Quantizer>(Ready<Q>);

enum Ready<Q: Quantizer> {
    Values(Q::Values),
    Bf16(Q::Kept),
    /// qgZ's bf16 hop inside the node: [`qgz::bf16_runs`].
    Bf16Runs(Q::Kept),
    FirstHop(Q::Chunks),
}

/// What a reduce-scatter of `grad` (taken) on `wire` can do before it is
/// its turn to move: a bf16 ring rounds it to bf16 (nearest even); qgZ
/// quantizes its hop inside the node (a node of more than one rank:
/// [`qgz::quantize_first_hop`], rounding as `rounding`, adding `first`'s
/// residual and keeping what it drops there), or in bf16 rounds it into
/// each local rank's run ([`qgz::bf16_runs`]). Where it rounds to bf16 the
/// f32 buffer goes back at once: a call in flight holds half the bytes.
pub fn prepare_gradient<Q: Quantizer>(
    q: &Q,
    layout: Layout,
    wire: GradWire,
    (rounding, first): (Rounding, Option<&mut Q::Chunks>),
    grad: Q::Values,
) -> Result<Gradient<Q>, ZeroError> {
    if !wire.keeps(layout.ranks_per_node).0 {
        qgz::no_first_feedback(&first)?;
    }
    let ready = match wire {
        GradWire::TwoHop {
            intra: FirstHop::Quantized(format),
            ..
        } if layout.ranks_per_node > 1 => Ready::FirstHop(qgz::quantize_first_hop(
            q, grad, layout, format, rounding, first,
        )?),
        GradWire::TwoHop {
            intra: FirstHop::Bf16,
            ..
        } if layout.ranks_per_node > 1 => Ready::Bf16Runs(qgz::bf16_runs(q, grad, layout)?),
        GradWire::RingBf16 => {
            let len = q.len(&grad);
            let mut words = q.kept_for_overwrite(len, true)?;
            q.store_kept(&grad, 0, &mut words, 0, len)?;
            q.recycle(grad);
            Ready::Bf16(words)
        }
        _ => Ready::Values(grad),
    };
    Ok(Gradient(ready))
}

/// [`reduce_scatter`] of a gradient made ready by [`prepare_gradient`],
/// which the call takes (its buffers go back to the pools): this rank's
/// chunk of the sum or mean (`reduction`) in f32, before any rounding — a
/// ring sends from the values' own buffer, in bf16 on a bf16 ring (rounded
/// to nearest even); qgZ rounds its hop across nodes as `rounding` says
/// and adds and keeps `second`'s residual there.
#[allow(clippy::too_many_arguments)]
pub fn reduce_scatter_prepared<Q: Quantizer, M: ByteMover<Q>>(
    q: &Q,
    m: &M,
    layout: Layout,
    wire: GradWire,
    (rounding, second): (Rounding, Option<&mut Q::Chunks>),
    reduction: Reduction,
    grad: Gradient<Q>,
) -> Result<Q::Values, ZeroError> {
    let (ring, mean) = ((Hop::World, Phase::Gradient), reduction == Reduction::Mean);
    match (wire.qgz(rounding), grad.0) {
        (None, Ready::Values(values)) if wire == GradWire::RingF32 => {
            m.reduce_scatter_taking(q, ring, values, mean)
        }
        (None, Ready::Bf16(words)) if wire == GradWire::RingBf16 => {
            m.reduce_scatter_kept(q, ring, words, mean)
        }
        (Some(s), Ready::FirstHop(first)) => {
            let second = qgz::SecondHop::of(s, second);
            qgz::exchange(q, m, layout, first, second, reduction)
        }
        (Some(s), Ready::Bf16Runs(runs)) if s.intra == FirstHop::Bf16 => {
            let second = qgz::SecondHop::of(s, second);
            qgz::exchange_bf16(q, m, layout, runs, second, reduction)
        }
        (Some(s), Ready::Values(values))
            if s.intra == FirstHop::Bf16 || layout.ranks_per_node == 1 =>
        {
            let feedback = qgz::Feedback {
                first: None,
                second,
            };
            qgz::reduce_scatter_taking(q, m, layout, (s, reduction), values, feedback)
        }
        _ => Err(ZeroError::Invalid(
            "a gradient made ready for one wire is sent on another: prepare it for the wire it \
             is sent on"
                .into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::emulated::Emulated;
    use crate::host::{Host, HostKernels, HostMover};
    use crate::plan;
    use crate::testing::{self, bf16s, gradient, on_ranks};

    #[test]
    fn a_gradient_is_made_ready_with_a_first_hop_residual_only_where_the_wire_keeps_one() {
        let (intra, inter) = plan::gradient_formats(4, 32, Some(64)).unwrap();
        let wire = GradWire::TwoHop {
            intra,
            inter,
            error_feedback: true,
            stochastic: false,
            hadamard: false,
        };
        let layout = |nodes, g| Layout {
            nodes,
            ranks_per_node: g,
            rank: 0,
        };
        let ready = |layout: Layout, wire: GradWire| {
            let mut r = Host.chunks(crate::residual::format(), 0, 0).unwrap();
            let how = (Rounding::NearestEven, Some(&mut r));
            prepare_gradient(&Host, layout, wire, how, gradient(0, 128)).map(|_| ())
        };
        // Two ranks a node: the int4 hop inside keeps its residual.
        ready(layout(2, 2), wire).unwrap();
        // A node of one rank has no hop inside it; a ring keeps nothing.
        for (l, w) in [(layout(2, 1), wire), (layout(2, 2), GradWire::RingF32)] {
            let e = ready(l, w).unwrap_err().to_string();
            assert!(e.contains("keeps no error feedback"), "{e}");
        }
    }

    /// qgZ with its hop inside the node in bf16 and error feedback across.
    fn bf16_inside() -> GradWire {
        let (intra, inter) = plan::gradient_formats(16, 32, Some(64)).unwrap();
        GradWire::TwoHop {
            intra,
            inter,
            error_feedback: true,
            stochastic: false,
            hadamard: true,
        }
    }

    #[test]
    fn a_gradient_made_ready_for_a_bf16_hop_inside_gives_its_f32_buffer_back_at_once() {
        // A length no other test takes: the next buffer of it is the
        // gradient's own, back in the pool before any byte moves.
        let len = 4 * 1531;
        let layout = Layout {
            nodes: 2,
            ranks_per_node: 2,
            rank: 0,
        };
        let grad = gradient(0, len);
        let at = grad.as_ptr();
        let how = (Rounding::NearestEven, None);
        let ready = prepare_gradient(&Host, layout, bf16_inside(), how, grad).unwrap();
        assert!(matches!(ready.0, Ready::Bf16Runs(_)));
        let again = zeropp_comm::scratch::take_for_overwrite::<f32>(len);
        assert_eq!(again.as_ptr(), at, "the f32 gradient was not given back");
    }

    #[test]
    fn a_gradient_made_ready_in_bf16_runs_sums_as_the_tensor_does_bit_for_bit() {
        // The runs each local rank is sent, made on the caller's thread,
        // give the reduce-scatter of the gradient as a tensor (which sends
        // its chunks from where they lie), error feedback across included:
        // two calls each, on 2 x 2 and 3 x 2 ranks.
        for nodes in [2, 3] {
            let len = nodes * 2 * 96;
            let got = on_ranks(nodes, 2, move |layout, m| {
                let wire = bf16_inside();
                let mut outs = Vec::new();
                for prepared in [true, false] {
                    let mut residual = crate::residual::Residual::none();
                    for call in 0..2 {
                        let grad = gradient(layout.rank + call, len);
                        let second = Some(residual.chunks_mut());
                        let nearest = Rounding::NearestEven;
                        let out = if prepared {
                            let how = (nearest, None);
                            let ready = prepare_gradient(&Host, layout, wire, how, grad).unwrap();
                            let how = (nearest, second);
                            let mean = Reduction::Mean;
                            reduce_scatter_prepared(&Host, m, layout, wire, how, mean, ready)
                                .unwrap()
                        } else {
                            let mut out = vec![0f32; len / layout.world()];
                            let fb = qgz::Feedback {
                                first: None,
                                second,
                            };
                            let (x, mut o) = (&grad[..], &mut out[..]);
                            let how = (nearest, fb);
                            reduce_scatter(
                                &Host,
                                m,
                                layout,
                                wire,
                                how,
                                Reduction::Mean,
                                &x,
                                &mut o,
                            )
                            .unwrap();
                            out
                        };
                        outs.push(out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>());
                    }
                }
                outs
            });
            for (rank, (outs, _)) in got.iter().enumerate() {
                assert_eq!(outs[..2], outs[2..], "{nodes} nodes, rank {rank}");
            }
        }
    }

    #[test]
    fn runs_that_are_not_finite_are_refused_on_every_rank_that_has_one() {
        let got = on_ranks(2, 2, |layout, m| {
            let wire = bf16_inside();
            let mut grad = gradient(layout.rank, 4 * 64);
            // Chunk 1 (rank 1's, bound for local rank 1): the second value
            // of local rank 1's run.
            grad[64 + 1] = f32::INFINITY;
            let how = (Rounding::NearestEven, None);
            let ready = prepare_gradient(&Host, layout, wire, how, grad).unwrap();
            let how = (Rounding::NearestEven, None);
            reduce_scatter_prepared(&Host, m, layout, wire, how, Reduction::Mean, ready)
                .unwrap_err()
                .to_string()
        });
        for (rank, (msg, _)) in got.iter().enumerate() {
            assert!(
                msg.contains("value inf at index 1 of local rank 1's run is not finite"),
                "rank {rank}: {msg}"
            );
        }
    }

    #[test]
    fn a_plain_reduce_scatter_is_the_sum_or_mean_of_every_ranks_chunk() {
        let len = 4 * 37;
        for mean in [false, true] {
            let reduction = if mean {
                Reduction::Mean
            } else {
                Reduction::Sum
            };
            let got = on_ranks(2, 2, move |layout, m| {
                let grad = gradient(layout.rank, len);
                let mut out = vec![0f32; len / 4];
                let (x, mut o) = (&grad[..], &mut out[..]);
                let (ring, call) = (
                    GradWire::RingF32,
                    (Rounding::NearestEven, qgz::Feedback::none()),
                );
                reduce_scatter(&Host, m, layout, ring, call, reduction, &x, &mut o).unwrap();
                // A bf16 ring takes bf16 tensors only.
                let bf16 = (Rounding::NearestEven, qgz::Feedback::none());
                let e = reduce_scatter(
                    &Host,
                    m,
                    layout,
                    GradWire::RingBf16,
                    bf16,
                    reduction,
                    &x,
                    &mut o,
                );
                assert!(e.unwrap_err().to_string().contains("GradWire::for_call"));
                out
            });
            for (rank, (chunk, _)) in got.iter().enumerate() {
                for (i, v) in chunk.iter().enumerate() {
                    let at = rank * (len / 4) + i;
                    let mut exact: f32 = (0..4).map(|r| gradient(r, len)[at]).sum();
                    if mean {
                        exact /= 4.0;
                    }
                    assert!(
                        (v - exact).abs() <= 1e-6,
                        "rank {rank} value {i}: {v} vs {exact}"
                    );
                }
            }
        }
    }

    /// Every kind of gather (twice each: a weight difference needs a
    /// reference) and reduce-scatter on rank `layout.rank`'s inputs, with
    /// `k` quantizing: the outputs' bits.
    fn every_call<K: HostKernels>(k: &K, layout: Layout, m: &HostMover<'_>) -> Vec<Vec<u16>> {
        let len = 4 * 300;
        let grad = bf16s(&gradient(layout.rank, len));
        let shard = bf16s(&gradient(layout.rank + 10, len / 4));
        let mut outs = Vec::new();
        let mut reference = None;
        for wire in testing::every_weight_wire(4, 256) {
            let how = wire.for_call(true, true);
            for _ in 0..2 {
                let mut out = vec![bf16::ZERO; len];
                let (x, mut o) = (&shard[..], &mut out[..]);
                let r = Some(Slot::new(&mut reference));
                let phase = Phase::ForwardGather;
                all_gather(k, m, layout, Hop::World, how, phase, r, &x, &mut o).unwrap();
                outs.push(out.iter().map(|v| v.to_bits()).collect());
            }
        }
        // The engine's f32 masters on a bf16 wire, widened back.
        let masters = gradient(layout.rank + 20, len / 4);
        let mut out = vec![0f32; len];
        let (x, mut o) = (&masters[..], &mut out[..]);
        let phase = Phase::ForwardGather;
        let bf16 = WeightWire::Bf16;
        all_gather(k, m, layout, Hop::World, bf16, phase, None, &x, &mut o).unwrap();
        let words = |out: &[f32]| -> Vec<u16> {
            let halves = |v: &f32| [v.to_bits() as u16, (v.to_bits() >> 16) as u16];
            out.iter().flat_map(halves).collect()
        };
        outs.push(words(&out));
        // The same through f32 values (what a device's mover does).
        let mut again = vec![0f32; len];
        let (x, mut o) = (&masters[..], &mut again[..]);
        crate::backend::all_gather_tensor_bf16_by_values(m, k, (Hop::World, phase), &x, &mut o)
            .unwrap();
        assert_eq!(words(&again), words(&out));
        let (intra, inter) = plan::gradient_formats(8, 32, Some(128)).unwrap();
        let two_hop = GradWire::TwoHop {
            intra,
            inter,
            error_feedback: false,
            stochastic: false,
            hadamard: true,
        };
        for (quantized, reduction) in [
            (false, Reduction::Sum),
            (false, Reduction::Mean),
            (true, Reduction::Mean),
        ] {
            let how = match quantized {
                false => GradWire::RingF32.for_call(true),
                true => two_hop.for_call(true),
            };
            let call = (zeropp_quant::Rounding::NearestEven, qgz::Feedback::none());
            let mut out = vec![bf16::ZERO; len / 4];
            let (x, mut o) = (&grad[..], &mut out[..]);
            reduce_scatter(k, m, layout, how, call, reduction, &x, &mut o).unwrap();
            outs.push(out.iter().map(|v| v.to_bits()).collect());
        }
        outs
    }

    #[test]
    fn the_emulated_device_and_the_host_agree_bit_for_bit_on_every_call() {
        // The same inputs through zeropp-quant and through the CUDA
        // kernels' own source.
        let host = on_ranks(2, 2, |layout, m| every_call(&Host, layout, m));
        let emulated = on_ranks(2, 2, |layout, m| every_call(&Emulated, layout, m));
        assert_eq!(host, emulated);
        // The plain gather is exact: every rank's shard in rank order.
        let expect: Vec<u16> = (0..4)
            .flat_map(|r| bf16s(&gradient(r + 10, 300)))
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(host[1].0[0], expect);
        // f32 on a bf16 wire: every rank's values rounded to bf16.
        let expect: Vec<u16> = (0..4)
            .flat_map(|r| bf16s(&gradient(r + 20, 300)))
            .flat_map(|v| [0, v.to_bits()])
            .collect();
        assert_eq!(host[1].0[6], expect);
    }

    #[test]
    fn a_gather_refuses_what_it_cannot_run() {
        // A sub-group's gather and the plan's plain wires move the bytes as
        // they are; differences of f32 tensors keep f32 inside the node.
        let [plain, quantized, delta] = testing::every_weight_wire(8, 256);
        assert_eq!(quantized.for_call(false, true), WeightWire::Bf16);
        assert_eq!(quantized.for_call(false, false), WeightWire::F32);
        assert_eq!(plain.for_call(true, true), WeightWire::Bf16);
        assert_eq!(plain.for_call(true, false), WeightWire::F32);
        match delta.for_call(true, false) {
            WeightWire::Delta(d) => assert!(d.fp32),
            other => panic!("{other:?}"),
        }
        let r = on_ranks(1, 2, |layout, m| {
            let shard = [1f32; 8];
            let mut out = [0f32; 8];
            let (x, mut o) = (&shard[..], &mut out[..]);
            let phase = Phase::ForwardGather;
            let e = all_gather(
                &Host,
                m,
                layout,
                Hop::World,
                WeightWire::F32,
                phase,
                None,
                &x,
                &mut o,
            );
            e.unwrap_err().to_string()
        });
        assert!(r[0].0.contains("does not fill"), "{}", r[0].0);
    }
}
