//! qwZ: the forward weight gather. Each rank's chunk travels quantized
//! (int8 or int4 blocks) across nodes among equal local ranks, then inside
//! the node as one bundle per rank, and is dequantized into the full
//! buffer; unquantized chunks go round the world in one ring.

use bytes::{Bytes, BytesMut};
use zeropp_quant::Element;

use crate::comm::{CommError, Communicator};

use super::groups::ZeroGroups;
use super::payload;
use super::plan::{Layout, WeightWire};

/// The share of a quantized chunk's bytes that are block scales (0 for
/// unquantized wires): what the byte counters report apart.
pub fn scale_fraction(wire: WeightWire, chunk: usize) -> f64 {
    match wire {
        WeightWire::Bf16 | WeightWire::F32 => 0.0,
        WeightWire::Quantized(f) => f.param_bytes(chunk) as f64 / f.total_bytes(chunk) as f64,
    }
}

/// This rank's chunk as it goes on the wire: bf16 or f32 values, or one
/// quantized message (round to nearest).
pub fn encode_chunk<T: Element>(chunk: &[T], wire: WeightWire) -> Result<Bytes, CommError> {
    match wire {
        WeightWire::Bf16 => Ok(payload::encode_bf16(chunk)),
        WeightWire::F32 => Ok(payload::encode_f32(chunk)),
        WeightWire::Quantized(f) => payload::quantize_message(chunk, f),
    }
}

/// Gathers every rank's `mine` in rank order: hierarchically (across nodes,
/// then inside the node) when `hierarchical`, else in one ring over the
/// world.
pub fn gather(
    c: &Communicator,
    groups: &ZeroGroups,
    layout: Layout,
    mine: Bytes,
    hierarchical: bool,
) -> Result<Vec<Bytes>, CommError> {
    if !hierarchical || layout.nodes == 1 || layout.ranks_per_node == 1 {
        return c.all_gather_v(&groups.world, mine);
    }
    let (nodes, g) = (layout.nodes, layout.ranks_per_node);
    let across = c.all_gather_v(&groups.cross, mine)?; // node order
    let bundles = c.all_gather_v(&groups.node, concat(&across))?; // local order
    let mut by_rank = vec![Bytes::new(); nodes * g];
    for (local, bundle) in bundles.iter().enumerate() {
        for (n, p) in split_bundle(bundle, nodes)?.into_iter().enumerate() {
            by_rank[n * g + local] = p;
        }
    }
    Ok(by_rank)
}

/// Decodes gathered payloads (rank order, `chunk` values each) into `out`
/// (`payloads.len() · chunk` values).
pub fn decode_into<T: Element>(
    payloads: &[Bytes],
    wire: WeightWire,
    chunk: usize,
    out: &mut [T],
) -> Result<(), CommError> {
    if out.len() != payloads.len() * chunk {
        return Err(CommError::Invalid(format!(
            "a gather of {} chunks of {chunk} values does not fill {} values",
            payloads.len(),
            out.len()
        )));
    }
    let mut scratch = Vec::new();
    for (r, p) in payloads.iter().enumerate() {
        let out = &mut out[r * chunk..(r + 1) * chunk];
        match wire {
            WeightWire::Bf16 | WeightWire::F32 => {
                scratch.resize(chunk, 0f32);
                if wire == WeightWire::Bf16 {
                    payload::decode_bf16(p, &mut scratch)?;
                } else {
                    payload::decode_f32(p, &mut scratch)?;
                }
                out.iter_mut()
                    .zip(&scratch)
                    .for_each(|(o, v)| *o = T::from_f32(*v));
            }
            WeightWire::Quantized(f) => {
                let d = payload::decode_quantized(p, f, chunk)?;
                zeropp_quant::dequantize(d.view(), out)
                    .map_err(|e| CommError::Malformed(format!("rank {r}'s chunk: {e}")))?;
            }
        }
    }
    Ok(())
}

/// Splits the concatenated payloads of a bundle into equal parts.
pub fn split_bundle(bundle: &Bytes, parts: usize) -> Result<Vec<Bytes>, CommError> {
    if parts == 0 || !bundle.len().is_multiple_of(parts) {
        return Err(CommError::Malformed(format!(
            "a bundle of {} bytes does not split into {parts} chunks",
            bundle.len()
        )));
    }
    let len = bundle.len() / parts;
    Ok((0..parts)
        .map(|i| bundle.slice(i * len..(i + 1) * len))
        .collect())
}

/// The parts back to back, as one message.
pub fn concat(parts: &[Bytes]) -> Bytes {
    let mut b = BytesMut::with_capacity(parts.iter().map(Bytes::len).sum());
    for p in parts {
        b.extend_from_slice(p);
    }
    b.freeze()
}
