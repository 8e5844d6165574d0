//! FSDP2's two collectives on one parameter group — the all-gather of its
//! shards and the reduce-scatter of its gradient — as zeropp runs them,
//! written once over a [`Quantizer`] and a [`ByteMover`]. `zeropp.torch`'s
//! host path, its emulated device and its CUDA path all call these; only
//! the backend differs.

use zeropp_cuda::GpuElement;
use zeropp_quant::QuantFormat;

use crate::backend::{ByteMover, Hop, Quantizer};
use crate::delta::{self, DeltaWire, Slot};
use crate::error::ZeroError;
use crate::layout::Layout;
use crate::qgz::{self, Reduction};
use crate::qwz;
use crate::traffic::Phase;

/// How an all-gather moves the weights: per call, from the group's plan
/// (`plan::WeightWire::gather`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Gather {
    /// The caller's bytes as they are: ZeRO-3, and hpZ's backward gather
    /// inside its group.
    Plain,
    /// qwZ: the shard quantized in this format, gathered across nodes then
    /// inside each.
    Quantized(QuantFormat),
    /// qwZ on weight differences against references the caller keeps.
    Delta(DeltaWire),
}

/// FSDP2's all-gather over `hop` (the world, or the hpZ group for a
/// sub-group's gather): `shard` (this rank's) into `out` (every member's,
/// in member order), moved as `how` says and counted under `phase`.
/// `slot` holds the references of [`Gather::Delta`] and the group's frozen
/// ranges (required there, unused otherwise).
#[allow(clippy::too_many_arguments)]
pub fn all_gather<Q: Quantizer, M: ByteMover<Q>, T: GpuElement>(
    q: &Q,
    m: &M,
    layout: Layout,
    hop: Hop,
    how: Gather,
    phase: Phase,
    slot: Option<Slot<'_, Q::Kept>>,
    shard: &Q::Tensor<'_, T>,
    out: &mut Q::TensorMut<'_, T>,
) -> Result<(), ZeroError> {
    if q.tensor_len(shard) == 0 {
        return Ok(());
    }
    if how != Gather::Plain && m.size(hop) != layout.world() {
        return Err(ZeroError::Invalid(format!(
            "qwZ gathers over the world ({} ranks), not over a group of {}",
            layout.world(),
            m.size(hop)
        )));
    }
    match how {
        Gather::Plain => m.all_gather_tensor(hop, phase, shard, out),
        Gather::Quantized(format) => {
            let all = qwz::gather_quantized(q, m, layout, shard, format, phase)?;
            qwz::dequantize_all(q, &all, |r| qwz::gathered_position(layout, r), out)?;
            q.recycle_chunks(all);
            Ok(())
        }
        Gather::Delta(wire) => {
            let slot = slot.ok_or_else(|| {
                ZeroError::Invalid("qwZ on weight differences needs the group's references".into())
            })?;
            delta::gather(q, m, layout, wire, slot, shard, out, phase)
        }
    }
}

/// How a reduce-scatter sums.
pub enum Scatter<'a, Q: Quantizer> {
    /// ZeRO-3's reduce-scatter in the tensor's type (the host's rings,
    /// NCCL's on the device).
    Plain,
    /// qgZ with these settings and this error feedback.
    Qgz(qgz::Qgz, qgz::Feedback<'a, Q>),
}

/// FSDP2's reduce-scatter over the world: `grad` (W equal chunks, rank
/// order) summed or averaged over every rank as `reduction` says, this
/// rank's chunk into `out` (counted as the gradient phase). qgZ widens the
/// gradient to f32, sums in f32 and rounds the result to `T` once.
pub fn reduce_scatter<Q: Quantizer, M: ByteMover<Q>, T: GpuElement>(
    q: &Q,
    m: &M,
    layout: Layout,
    how: Scatter<'_, Q>,
    reduction: Reduction,
    grad: &Q::Tensor<'_, T>,
    out: &mut Q::TensorMut<'_, T>,
) -> Result<(), ZeroError> {
    let len = q.tensor_len(grad);
    if len == 0 {
        return Ok(());
    }
    match how {
        Scatter::Plain => {
            let mean = reduction == Reduction::Mean;
            m.reduce_scatter_tensor(q, Hop::World, Phase::Gradient, grad, out, mean)
        }
        Scatter::Qgz(s, feedback) => {
            let sum = qgz::reduce_scatter_tensor(q, m, layout, (s, reduction), grad, feedback)?;
            q.store_values(&sum, 0, out, 0, q.len(&sum))?;
            q.recycle(sum);
            Ok(())
        }
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
                reduce_scatter(&Host, m, layout, Scatter::Plain, reduction, &x, &mut o).unwrap();
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
            let how = wire.gather(true, true);
            for _ in 0..2 {
                let mut out = vec![bf16::ZERO; len];
                let (x, mut o) = (&shard[..], &mut out[..]);
                let r = Some(Slot::new(&mut reference));
                let phase = Phase::ForwardGather;
                all_gather(k, m, layout, Hop::World, how, phase, r, &x, &mut o).unwrap();
                outs.push(out.iter().map(|v| v.to_bits()).collect());
            }
        }
        let (intra, inter) = plan::gradient_formats(8, 32, Some(128)).unwrap();
        for (quantized, reduction) in [
            (false, Reduction::Sum),
            (false, Reduction::Mean),
            (true, Reduction::Mean),
        ] {
            let how = match quantized {
                false => Scatter::Plain,
                true => Scatter::Qgz(
                    qgz::Qgz {
                        intra,
                        inter,
                        rounding: zeropp_quant::Rounding::NearestEven,
                        hadamard: true,
                    },
                    qgz::Feedback {
                        first: None,
                        second: None,
                    },
                ),
            };
            let mut out = vec![bf16::ZERO; len / 4];
            let (x, mut o) = (&grad[..], &mut out[..]);
            reduce_scatter(k, m, layout, how, reduction, &x, &mut o).unwrap();
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
    }

    #[test]
    fn a_gather_refuses_what_it_cannot_run() {
        // A sub-group's gather and the plan's plain wires move the bytes as
        // they are; differences of f32 tensors keep f32 inside the node.
        let [plain, quantized, delta] = testing::every_weight_wire(8, 256);
        assert_eq!(quantized.gather(false, true), Gather::Plain);
        assert_eq!(plain.gather(true, true), Gather::Plain);
        match delta.gather(true, false) {
            Gather::Delta(d) => assert!(d.fp32),
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
                Gather::Plain,
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
