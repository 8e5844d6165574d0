//! The all-reduce across replicas — HSDP's hop over the replicate dimension
//! of a mesh, where every replica holds the same shard and must end with
//! the same gradient — quantized, written once over a [`Quantizer`] and a
//! [`ByteMover`] (the plain one, ZeRO-3's reduce-scatter and all-gather in
//! the tensor's own type, is the host mover's
//! `HostMover::all_reduce_tensor`). Each member owns 1/R of the
//! buffer; int4 blocks go all-to-all, the owner sums them in f32, and its
//! part goes back quantized once, so every replica dequantizes the same
//! codes and the replicas stay bit-identical. Error feedback keeps what
//! each of the two quantizations dropped; the blocks can be rotated
//! (Walsh–Hadamard) before quantizing, as qgZ's hop across nodes is.

use zeropp_cuda::GpuElement;
use zeropp_quant::{QuantFormat, Rounding};

use crate::backend::{ByteMover, Hop, Quantizer};
use crate::error::ZeroError;
use crate::qgz::{Reduction, quantize_kept};
use crate::traffic::Phase;

/// The settings of a quantized all-reduce.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantizedAllReduce {
    /// The wire format of both quantizations (qgZ's hop across nodes).
    pub format: QuantFormat,
    pub rounding: Rounding,
    /// Rotate each block (Walsh–Hadamard) before quantizing; the sums are
    /// taken rotated and rotated back at the end.
    pub hadamard: bool,
}

/// Error feedback of one buffer's all-reduce: what the last call dropped
/// quantizing this member's contributions (`sent`, R parts) and its own
/// part of the result (`owned`, one part). `None`: no feedback there.
pub struct ReplicaFeedback<'a, Q: Quantizer> {
    pub sent: Option<&'a mut Q::Chunks>,
    pub owned: Option<&'a mut Q::Chunks>,
}

/// The values each of `members` owns of a buffer of `len`: an equal share,
/// rounded up to whole blocks of `block` (the buffer is padded with zeros).
pub fn part_len(len: usize, members: usize, block: usize) -> usize {
    len.div_ceil(members.max(1)).div_ceil(block.max(1)) * block.max(1)
}

/// `x` (this member's f32 values) replaced by the sum, or the mean
/// (`reduction`), over every member of `hop`, moved quantized as `s` says;
/// every member ends with the same values, bit for bit.
pub fn all_reduce_quantized<Q: Quantizer, M: ByteMover<Q>>(
    q: &Q,
    m: &M,
    (hop, phase): (Hop, Phase),
    s: QuantizedAllReduce,
    reduction: Reduction,
    x: &mut Q::Values,
    feedback: ReplicaFeedback<'_, Q>,
) -> Result<(), ZeroError> {
    let (members, len, block) = (m.size(hop), q.len(x), s.format.block);
    if members <= 1 || len == 0 {
        return Ok(());
    }
    let part = part_len(len, members, block);
    let mut work = q.values(part * members)?;
    q.copy(x, 0, &mut work, 0, len)?;
    if s.hadamard {
        q.rotate(&mut work, 0, part * members, block)?;
    }
    // This member's contributions: part j for member j.
    let mut sent = q.chunks(s.format, part, members)?;
    quantize_kept(q, &mut work, members, s.rounding, &mut sent, feedback.sent)?;
    let mut got = q.chunks(s.format, part, members)?;
    m.all_to_all(q, hop, phase, &sent, &mut got)?;
    q.recycle_chunks(sent);
    // This member's part of the result, summed in f32 in member order.
    let mut mine = q.values(part)?;
    for j in 0..members {
        q.dequantize_accumulate(&got, j, &mut mine, 0)?;
    }
    q.recycle_chunks(got);
    if reduction == Reduction::Mean {
        q.divide(&mut mine, members as f32)?;
    }
    let mut owned = q.chunks(s.format, part, 1)?;
    let rounding = s.rounding.for_part(members);
    quantize_kept(q, &mut mine, 1, rounding, &mut owned, feedback.owned)?;
    // Every member's part, and this member's own from the same codes.
    let mut all = q.chunks(s.format, part, members)?;
    m.all_gather(q, hop, phase, &owned, &mut all)?;
    q.recycle(mine);
    q.recycle_chunks(owned);
    for j in 0..members {
        q.dequantize(&all, j, &mut work, j * part)?;
    }
    q.recycle_chunks(all);
    if s.hadamard {
        q.rotate(&mut work, 0, part * members, block)?;
    }
    q.copy(&work, 0, x, 0, len)?;
    q.recycle(work);
    Ok(())
}

/// The quantized all-reduce of `x` (a caller's tensor) over `hop` into
/// `out` (as long): the sum or mean over every member, the same on every
/// member, summed in f32 and rounded to `T` once. (The plain route, ZeRO-3's
/// reduce-scatter and all-gather in `T`, is the byte mover's.)
#[allow(clippy::too_many_arguments)]
pub fn all_reduce<Q: Quantizer, M: ByteMover<Q>, T: GpuElement>(
    q: &Q,
    m: &M,
    (hop, phase): (Hop, Phase),
    s: QuantizedAllReduce,
    reduction: Reduction,
    feedback: ReplicaFeedback<'_, Q>,
    x: &Q::Tensor<'_, T>,
    out: &mut Q::TensorMut<'_, T>,
) -> Result<(), ZeroError> {
    let len = q.tensor_len(x);
    let mut values = q.values(len)?;
    q.load_tensor(x, &mut values, 0)?;
    all_reduce_quantized(q, m, (hop, phase), s, reduction, &mut values, feedback)?;
    q.store_values(&values, 0, out, 0, len)?;
    q.recycle(values);
    Ok(())
}

#[cfg(test)]
mod tests {
    use zeropp_quant::QuantizedChunks;

    use super::*;
    use crate::host::Host;
    use crate::testing::{bf16s, gradient, on_ranks};

    const CROSS: (Hop, Phase) = (Hop::Cross, Phase::Replicate);

    fn settings(hadamard: bool) -> QuantizedAllReduce {
        QuantizedAllReduce {
            format: QuantFormat::int4(64).unwrap(),
            rounding: Rounding::NearestEven,
            hadamard,
        }
    }

    /// Member `r`'s buffer: heavy-tailed values, one outlier per 97.
    fn buffer(r: usize, len: usize) -> Vec<f32> {
        let mut x = gradient(r + 5, len);
        for (i, v) in x.iter_mut().enumerate() {
            if i % 97 == r {
                *v *= 40.0;
            }
        }
        x
    }

    fn exact_mean(members: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (0..members).map(|r| buffer(r, len)[i]).sum::<f32>() / members as f32)
            .collect()
    }

    fn rms(x: impl Iterator<Item = f32>) -> f32 {
        let (mut s, mut n) = (0f64, 0usize);
        for v in x {
            s += (v as f64).powi(2);
            n += 1;
        }
        (s / n.max(1) as f64).sqrt() as f32
    }

    #[test]
    fn every_replica_ends_with_the_same_mean_within_int4s_error() {
        // Three replicas (a cross group of 3 nodes), a length that is no
        // multiple of 3 or of the block: padded inside, cut back after.
        let len = 1000;
        let mut errors = vec![];
        for hadamard in [false, true] {
            let got = on_ranks(3, 1, move |layout, m| {
                let mut x = buffer(layout.rank, len);
                let feedback = ReplicaFeedback::<Host> {
                    sent: None,
                    owned: None,
                };
                let s = settings(hadamard);
                all_reduce_quantized(&Host, m, CROSS, s, Reduction::Mean, &mut x, feedback)
                    .unwrap();
                x
            });
            let exact = exact_mean(3, len);
            for (r, (x, _)) in got.iter().enumerate() {
                assert_eq!(x.len(), len);
                assert_eq!(
                    x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    got[0].0.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "replica {r} differs from replica 0 (hadamard {hadamard})"
                );
            }
            errors.push(rms(got[0].0.iter().zip(&exact).map(|(a, b)| a - b)));
        }
        // int4 blocks whose scale an outlier sets: the rotation spreads it.
        let scale = rms(exact_mean(3, len).into_iter());
        assert!(
            errors[0] <= 0.3 * scale && errors[1] <= 0.7 * errors[0],
            "rms errors {errors:?} (plain, rotated) against rms {scale}"
        );
    }

    #[test]
    fn error_feedback_keeps_the_sum_over_calls_close_to_the_exact_one() {
        // The same buffers every call: without feedback the error repeats
        // and adds up; with it, what one call drops the next one sends.
        let (len, calls) = (640, 16);
        let drift = |feedback: bool| {
            let got = on_ranks(2, 1, move |layout, m| {
                let (mut sent, mut owned) = (
                    QuantizedChunks::zeroed(settings(true).format, 0, 0),
                    QuantizedChunks::zeroed(settings(true).format, 0, 0),
                );
                let mut total = vec![0f32; len];
                for _ in 0..calls {
                    let mut x = buffer(layout.rank, len);
                    let f = ReplicaFeedback::<Host> {
                        sent: feedback.then_some(&mut sent),
                        owned: feedback.then_some(&mut owned),
                    };
                    all_reduce_quantized(
                        &Host,
                        m,
                        CROSS,
                        settings(true),
                        Reduction::Sum,
                        &mut x,
                        f,
                    )
                    .unwrap();
                    for (t, v) in total.iter_mut().zip(&x) {
                        *t += v;
                    }
                }
                total
            });
            let exact: Vec<f32> = exact_mean(2, len)
                .iter()
                .map(|v| v * 2.0 * calls as f32)
                .collect();
            assert_eq!(got[0].0, got[1].0, "the replicas differ");
            rms(got[0].0.iter().zip(&exact).map(|(a, b)| a - b))
        };
        let (with, without) = (drift(true), drift(false));
        assert!(
            with < 0.2 * without,
            "error of the summed calls: {with} with feedback, {without} without"
        );
    }

    #[test]
    fn the_quantized_route_sends_under_a_third_of_a_bf16_all_reduce() {
        let len = 4096;
        let sent = |quantized: bool| {
            on_ranks(2, 2, move |layout, m| {
                let x = bf16s(&buffer(layout.rank, len));
                let mut out = vec![half::bf16::ZERO; len];
                if quantized {
                    let f = ReplicaFeedback::<Host> {
                        sent: None,
                        owned: None,
                    };
                    let s = settings(true);
                    all_reduce(
                        &Host,
                        m,
                        CROSS,
                        s,
                        Reduction::Mean,
                        f,
                        &&x[..],
                        &mut &mut out[..],
                    )
                    .unwrap();
                } else {
                    out.copy_from_slice(&x);
                    m.all_reduce_tensor(&Host, CROSS, &mut out, true).unwrap();
                }
                out
            })
        };
        let (q, plain) = (sent(true), sent(false));
        for r in 1..4 {
            // Replicas across nodes agree; both routes near the exact mean.
            let peer = r ^ 2;
            assert_eq!(q[r].0, q[peer].0);
            assert_eq!(plain[r].0, plain[peer].0);
        }
        // Rank 0's cross group: ranks 0 and 2.
        let (b0, b2) = (buffer(0, len), buffer(2, len));
        let exact: Vec<f32> = b0.iter().zip(&b2).map(|(a, b)| (a + b) / 2.0).collect();
        let plain_err = rms(plain[0].0.iter().zip(&exact).map(|(a, b)| a.to_f32() - b));
        assert!(
            plain_err <= 0.01 * rms(exact.iter().copied()),
            "{plain_err}"
        );
        let ratio = q[0].1 as f64 / plain[0].1 as f64;
        assert!(
            ratio <= 0.3,
            "quantized bytes across nodes {ratio:.3} of bf16's"
        );
    }

    #[test]
    fn a_plain_all_reduce_of_two_f32_replicas_is_their_exact_sum() {
        // An odd length: padded to whole parts inside, cut back after.
        let len = 301;
        let got = on_ranks(2, 1, move |layout, m| {
            let mut x = buffer(layout.rank, len);
            m.all_reduce_tensor(&Host, CROSS, &mut x, false).unwrap();
            x
        });
        for (x, _) in &got {
            for (i, v) in x.iter().enumerate() {
                assert_eq!(*v, buffer(0, len)[i] + buffer(1, len)[i]);
            }
        }
    }

    #[test]
    fn parts_are_whole_blocks_covering_the_buffer() {
        for (len, members, block) in [(1000, 3, 64), (64, 2, 64), (1, 4, 32), (6400, 2, 64)] {
            let p = part_len(len, members, block);
            assert_eq!(p % block, 0);
            assert!(p * members >= len && (p - block) * members < len);
        }
    }
}
