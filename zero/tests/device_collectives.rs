//! One implementation of each ZeRO++ collective (`zeropp_zero::{qgz, qwz,
//! hpz}`), every backend: the host library, the emulated device (the CUDA
//! kernels' own source on host buffers) and the GPU. Each rank of an
//! in-process job runs the collective over its backend and the host
//! transports; the results, the error-feedback residuals and the bytes
//! counted agree bit for bit, call after call (round to nearest).

use std::sync::Arc;
use std::time::Duration;

use zeropp_comm::Communicator;
use zeropp_comm::inproc::InProcess;
use zeropp_quant::{QuantFormat, QuantizedChunks, Rounding};
use zeropp_zero::emulated::Emulated;
use zeropp_zero::host::{Host, HostKernels, HostMover};
use zeropp_zero::layout::Layout;
use zeropp_zero::plan;
use zeropp_zero::qgz::{self, Feedback, Qgz, Reduction};
use zeropp_zero::traffic::Phase;
use zeropp_zero::traffic::{CountingTransport, Traffic};
use zeropp_zero::{Quantizer, ZeroGroups};
use zeropp_zero::{delta, hpz, qwz};

/// A gradient that is different on every rank and call, with a few large
/// values so blocks have different scales.
fn gradient(len: usize, rank: usize, call: usize) -> Vec<f32> {
    let mut s =
        (rank as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((call as u64 + 7) * 0xbf58_476d);
    (0..len)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            if i % 97 == 0 { u * 40.0 } else { u }
        })
        .collect()
}

/// What one rank saw over its calls: each result, both residuals after it,
/// and the bytes it sent.
#[derive(Debug, PartialEq)]
struct Seen {
    results: Vec<Vec<u32>>,
    residuals: Vec<(QuantizedChunks, QuantizedChunks)>,
    traffic: Traffic,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    nodes: usize,
    g: usize,
    chunk: usize,
    intra_bits: u32,
    feedback: bool,
    reduction: Reduction,
    calls: usize,
    /// The hop across nodes rotated (Walsh–Hadamard) before quantizing.
    hadamard: bool,
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Runs `case` on every rank of an in-process job with quantizer `q`.
fn run<Q>(case: Case, q: Q) -> Vec<Seen>
where
    Q: HostKernels + Copy + Send + 'static,
{
    let Case { nodes, g, .. } = case;
    on_ranks(nodes, g, g, move |layout, mover, counter| {
        let rank = layout.rank;
        let (intra, inter) = plan::gradient_formats(case.intra_bits, 32, None).unwrap();
        let settings = Qgz {
            intra,
            inter,
            rounding: Rounding::NearestEven,
            hadamard: case.hadamard,
        };
        let (mut r1, mut r2) = (
            q.chunks(inter, 0, 0).unwrap(),
            q.chunks(inter, 0, 0).unwrap(),
        );
        let mut seen = Seen {
            results: vec![],
            residuals: vec![],
            traffic: Traffic::default(),
        };
        for call in 0..case.calls {
            let grad = gradient(case.chunk * nodes * g, rank, call);
            let feedback = Feedback {
                first: (case.feedback && qgz::first_hop_feedback(true, intra, g))
                    .then_some(&mut r1),
                second: case.feedback.then_some(&mut r2),
            };
            let s = (settings, case.reduction);
            let out = qgz::reduce_scatter(&q, mover, layout, s, &grad, feedback).unwrap();
            assert_eq!(out.len(), case.chunk);
            seen.results.push(bits(&out));
            seen.residuals.push((r1.clone(), r2.clone()));
        }
        seen.traffic = counter.traffic();
        seen
    })
}

/// Runs `body` on every rank of an in-process job of `nodes` × `g` ranks
/// (hpZ groups of `hpz_group`) with the rank's layout, byte mover and
/// counters; the ranks' results in rank order.
fn on_ranks<R: Send + 'static>(
    nodes: usize,
    g: usize,
    hpz_group: usize,
    body: impl Fn(Layout, &HostMover<'_>, &CountingTransport) -> R + Clone + Send + 'static,
) -> Vec<R> {
    let handles: Vec<_> = InProcess::world(nodes * g)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let body = body.clone();
            std::thread::spawn(move || {
                let layout = Layout {
                    nodes,
                    ranks_per_node: g,
                    rank,
                };
                let counter = Arc::new(CountingTransport::new(Box::new(t), g));
                let comm = Communicator::new(counter.clone(), Duration::from_secs(60));
                let groups = ZeroGroups::new(&layout, hpz_group).unwrap();
                let mover = HostMover {
                    comm: &comm,
                    counter: &counter,
                    groups: groups.clone(),
                };
                body(layout, &mover, &counter)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

const CASES: [Case; 10] = [
    // One rank: quantize, requantize, dequantize, with feedback at both hops.
    Case {
        nodes: 1,
        g: 1,
        chunk: 4099,
        intra_bits: 4,
        feedback: true,
        reduction: Reduction::Mean,
        calls: 3,
        hadamard: false,
    },
    // The default plan of 2 x 2: int8 inside, feedback across nodes.
    Case {
        nodes: 2,
        g: 2,
        chunk: 640,
        intra_bits: 8,
        feedback: true,
        reduction: Reduction::Mean,
        calls: 3,
        hadamard: false,
    },
    // int4 inside with feedback at both hops; a mean by 6.
    Case {
        nodes: 3,
        g: 2,
        chunk: 256,
        intra_bits: 4,
        feedback: true,
        reduction: Reduction::Mean,
        calls: 2,
        hadamard: false,
    },
    // Chunks that are not whole blocks, no feedback (the fused kernel), a sum.
    Case {
        nodes: 2,
        g: 3,
        chunk: 101,
        intra_bits: 4,
        feedback: false,
        reduction: Reduction::Sum,
        calls: 2,
        hadamard: false,
    },
    // One node of four: no hop across nodes, the sums after the hop
    // inside are the result (an int4 hop inside, with its feedback).
    Case {
        nodes: 1,
        g: 4,
        chunk: 333,
        intra_bits: 4,
        feedback: true,
        reduction: Reduction::Mean,
        calls: 2,
        hadamard: false,
    },
    // The hop across nodes rotated, with feedback, on whole blocks.
    Case {
        nodes: 2,
        g: 2,
        chunk: 640,
        intra_bits: 8,
        feedback: true,
        reduction: Reduction::Mean,
        calls: 3,
        hadamard: true,
    },
    // Rotated chunks that end in part of a block, no feedback.
    Case {
        nodes: 3,
        g: 2,
        chunk: 101,
        intra_bits: 4,
        feedback: false,
        reduction: Reduction::Sum,
        calls: 2,
        hadamard: true,
    },
    // The gradient in bf16 inside the node, the hop across rotated with
    // its feedback.
    Case {
        nodes: 2,
        g: 2,
        chunk: 640,
        intra_bits: 16,
        feedback: true,
        reduction: Reduction::Mean,
        calls: 3,
        hadamard: true,
    },
    // bf16 inside, across unrotated (the fused sum-requantize is not
    // used: the sums come as f32), chunks that end in part of a block.
    Case {
        nodes: 3,
        g: 2,
        chunk: 101,
        intra_bits: 16,
        feedback: false,
        reduction: Reduction::Sum,
        calls: 2,
        hadamard: false,
    },
    // bf16 inside one node of three: the sums are the result.
    Case {
        nodes: 1,
        g: 3,
        chunk: 333,
        intra_bits: 16,
        feedback: true,
        reduction: Reduction::Mean,
        calls: 2,
        hadamard: false,
    },
];

#[test]
fn the_emulated_device_gives_the_host_librarys_qgz_bit_for_bit() {
    for case in CASES {
        let host = run(case, Host);
        let emulated = run(case, Emulated);
        for (rank, (h, e)) in host.iter().zip(&emulated).enumerate() {
            assert_eq!(h.results, e.results, "{case:?} rank {rank}: results");
            assert_eq!(h.residuals, e.residuals, "{case:?} rank {rank}: residuals");
            assert_eq!(h.traffic, e.traffic, "{case:?} rank {rank}: bytes");
        }
        // Feedback carries: with it, what was dropped is kept; bf16 inside
        // a single node quantizes nothing, so the residual passed for the
        // hop across (there is none) must stay untouched.
        if case.feedback {
            let (r1, r2) = host[0].residuals.last().unwrap();
            let kept = |r: &QuantizedChunks| r.block_max.iter().any(|&m| m > 0.0);
            let quantized = case.nodes > 1 || case.intra_bits != 16;
            assert_eq!(kept(r1) || kept(r2), quantized, "{case:?}");
        }
    }
}

#[test]
fn the_mean_is_the_sum_divided_by_the_world() {
    let mean = run(CASES[2], Host);
    let sum = run(
        Case {
            reduction: Reduction::Sum,
            ..CASES[2]
        },
        Host,
    );
    let w = (CASES[2].nodes * CASES[2].g) as f32;
    for (m, s) in mean.iter().zip(&sum) {
        for (m, s) in m.results.iter().zip(&s.results) {
            let want: Vec<u32> = s
                .iter()
                .map(|&b| (f32::from_bits(b) / w).to_bits())
                .collect();
            assert_eq!(m, &want);
        }
    }
}

#[test]
fn qgz_sums_what_every_rank_sent_to_within_the_quantization_error() {
    // Each value is off the exact f32 sum by at most half a step of every
    // quantization it went through: int8 blocks of each rank's gradient,
    // then int4 blocks of each node's partial sum.
    let case = Case {
        feedback: false,
        reduction: Reduction::Sum,
        calls: 1,
        ..CASES[1]
    };
    let seen = run(case, Host);
    let (nodes, g, chunk) = (case.nodes, case.g, case.chunk);
    let grads: Vec<Vec<f32>> = (0..nodes * g)
        .map(|r| gradient(chunk * nodes * g, r, 0))
        .collect();
    let absmax = |x: &[f32]| x.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (rank, s) in seen.iter().enumerate() {
        let got: Vec<f32> = s.results[0].iter().map(|&b| f32::from_bits(b)).collect();
        let mine = |r: usize| &grads[r][rank * chunk..(rank + 1) * chunk];
        for block in 0..chunk / 32 {
            let span = block * 32..(block + 1) * 32;
            let hop1: f32 = (0..nodes * g)
                .map(|r| absmax(&mine(r)[span.clone()]) / 254.0)
                .sum();
            let hop2: f32 = (0..nodes)
                .map(|n| {
                    let partial: Vec<f32> = span
                        .clone()
                        .map(|i| (0..g).map(|l| mine(n * g + l)[i]).sum())
                        .collect();
                    (absmax(&partial) + hop1) / 14.0
                })
                .sum();
            for i in span {
                let exact: f32 = (0..nodes * g).map(|r| mine(r)[i]).sum();
                assert!(
                    (got[i] - exact).abs() <= (hop1 + hop2) * 1.01 + 1e-6,
                    "rank {rank} value {i}: {} vs {exact}",
                    got[i]
                );
            }
        }
    }
}

/// qwZ's forward gather and hpZ's backward gather of the same weights on
/// every rank of a `nodes` x `g` job with quantizer `q`: each rank's full
/// weights after each, and its bytes.
fn gathers<Q>(
    nodes: usize,
    g: usize,
    hpz_group: usize,
    bits: u32,
    q: Q,
) -> Vec<(Vec<u32>, Vec<u32>, Traffic)>
where
    Q: HostKernels + Copy + Send + 'static,
{
    let chunk = 300; // not whole blocks of 256
    on_ranks(nodes, g, hpz_group, move |layout, mover, counter| {
        let rank = layout.rank;
        let format = plan::weight_format(bits, 256).unwrap();
        let shard: Vec<half::bf16> = gradient(chunk, rank, 9)
            .into_iter()
            .map(half::bf16::from_f32)
            .collect();
        let world = nodes * g;
        let all = qwz::gather_quantized::<_, _, half::bf16>(
            &q,
            mover,
            layout,
            &shard.as_slice(),
            format,
            Phase::ForwardGather,
        )
        .unwrap();
        let mut forward = vec![half::bf16::ZERO; chunk * world];
        let position = |r| qwz::gathered_position(layout, r);
        qwz::dequantize_all::<_, half::bf16>(&q, &all, position, &mut forward.as_mut_slice())
            .unwrap();
        let secondary = hpz::keep_quantized(&q, layout, &all, hpz_group).unwrap();
        drop(all);
        let secondary = hpz::Secondary::Quantized(secondary);
        let mut backward = vec![half::bf16::ZERO; chunk * world];
        hpz::all_gather_secondary(&q, mover, &secondary, false, &mut backward.as_mut_slice())
            .unwrap();
        let b = |x: &[half::bf16]| x.iter().map(|v| v.to_bits() as u32).collect();
        (b(&forward), b(&backward), counter.traffic())
    })
}

/// qwZ on weight differences over 4 gathers (a refresh, then int4 or int8
/// differences of bf16 shards that move a little each time), each followed
/// by a backward gather served from the references (hpZ over the node), on
/// every rank of a `nodes` x `g` job with quantizer `q`, the references
/// kept in `references` bits (32, 16 or int8 blocks): each rank's weights
/// after each gather, forward then backward, and its bytes.
fn delta_gathers<Q>(
    (nodes, g, bits): (usize, usize, u32),
    references: u32,
    q: Q,
) -> Vec<(Vec<Vec<u16>>, Traffic)>
where
    Q: HostKernels + Copy + Send + 'static,
{
    let chunk = 300; // not whole blocks of 64
    on_ranks(nodes, g, g, move |layout, mover, counter| {
        let wire = delta::DeltaWire {
            delta: plan::weight_format(bits, 64).unwrap(),
            refresh_every: 100,
            fp32: false,
            hpz: true,
            bf16_references: references == 16,
            int8_references: (references == 8).then(|| plan::weight_format(8, 256).unwrap()),
        };
        let world = nodes * g;
        let mut reference = None;
        let mut seen = Vec::new();
        for call in 0..4 {
            let shard: Vec<half::bf16> = gradient(chunk, layout.rank, 9)
                .iter()
                .zip(gradient(chunk, layout.rank, call))
                .map(|(w, d)| half::bf16::from_f32(w + 1e-3 * call as f32 * d))
                .collect();
            for phase in [Phase::ForwardGather, Phase::BackwardGather] {
                let mut out = vec![half::bf16::ZERO; chunk * world];
                let (x, o) = (&shard.as_slice(), &mut out.as_mut_slice());
                delta::gather(
                    &q,
                    mover,
                    layout,
                    wire,
                    delta::Slot::new(&mut reference),
                    x,
                    o,
                    phase,
                )
                .unwrap();
                seen.push(out.iter().map(|v| v.to_bits()).collect());
            }
        }
        (seen, counter.traffic())
    })
}

#[test]
fn weight_differences_gather_the_same_weights_on_every_backend() {
    let shapes = [(2, 2, 4), (3, 2, 8), (1, 3, 4)];
    let each = |s| [32, 16, 8].map(|refs| (s, refs));
    for ((nodes, g, bits), refs) in shapes.into_iter().flat_map(each) {
        let host = delta_gathers((nodes, g, bits), refs, Host);
        let emulated = delta_gathers((nodes, g, bits), refs, Emulated);
        let what = format!("{nodes} x {g}, int{bits} differences, {refs}-bit references");
        assert_eq!(host, emulated, "{what}");
        for (rank, (seen, traffic)) in host.iter().enumerate() {
            assert_eq!(seen, &host[0].0, "{what}: rank {rank}");
            // The backward gather delivers the forward's weights, from the
            // references inside the node: nothing of it crosses nodes.
            for pair in seen.chunks(2) {
                assert_eq!(pair[0], pair[1], "{what}: rank {rank} backward");
            }
            assert_eq!(traffic.backward_gather.total.inter_node, 0, "{what}");
            if g > 1 {
                assert_eq!(
                    traffic.backward_gather.total.intra_node,
                    traffic.forward_gather.total.intra_node,
                    "{what}: the node hop moves the same bytes forward and backward"
                );
            }
        }
    }
}

#[test]
fn qwz_and_hpz_gather_the_same_weights_on_every_backend() {
    for (nodes, g, hpz_group, bits) in [(2, 2, 2, 8), (2, 4, 2, 4), (3, 2, 2, 8), (1, 3, 3, 4)] {
        let host = gathers(nodes, g, hpz_group, bits, Host);
        let emulated = gathers(nodes, g, hpz_group, bits, Emulated);
        let what = format!("{nodes} x {g}, hpZ groups of {hpz_group}, int{bits}");
        assert_eq!(host, emulated, "{what}");
        // Every rank holds the same weights, forward and backward: each
        // rank's shard quantized once, dequantized where it belongs.
        for (rank, (forward, backward, traffic)) in host.iter().enumerate() {
            assert_eq!(forward, &host[0].0, "{what}: rank {rank} forward");
            assert_eq!(backward, forward, "{what}: rank {rank} backward");
            // The backward gather never leaves the node.
            assert_eq!(traffic.backward_gather.total.inter_node, 0, "{what}");
            assert!(traffic.backward_gather.total.intra_node > 0 || hpz_group == 1);
        }
        let shard0: Vec<f32> = gradient(300, 0, 9)
            .into_iter()
            .map(|v| half::bf16::from_f32(v).to_f32())
            .collect();
        let format = plan::weight_format(bits, 256).unwrap();
        let want: Vec<u32> =
            zeropp_quant::QuantizedTensor::quantize(&shard0, format, Rounding::NearestEven)
                .unwrap()
                .dequantize::<half::bf16>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits() as u32)
                .collect();
        assert_eq!(&host[0].0[..300], &want[..], "{what}: rank 0's chunk");
    }
}

/// One rank on GPU 0: NCCL communicators of one for the world, the node
/// and across nodes, and the counters its mover counts in.
struct OneGpu {
    gpu: zeropp_cuda::Gpu,
    world: zeropp_cuda::nccl::NcclComm,
    node: zeropp_cuda::nccl::NcclComm,
    cross: zeropp_cuda::nccl::NcclComm,
    counter: CountingTransport,
}

impl OneGpu {
    const LAYOUT: Layout = Layout {
        nodes: 1,
        ranks_per_node: 1,
        rank: 0,
    };

    fn open() -> OneGpu {
        use zeropp_cuda::nccl::{NcclComm, NcclId};
        let gpu = zeropp_cuda::Gpu::open(0).unwrap();
        let comm = || {
            NcclComm::init(&gpu, &NcclId::new().unwrap(), 0, 1, Duration::from_secs(30)).unwrap()
        };
        let (world, node, cross) = (comm(), comm(), comm());
        let counter = CountingTransport::new(Box::new(InProcess::world(1).pop().unwrap()), 1);
        OneGpu {
            gpu,
            world,
            node,
            cross,
            counter,
        }
    }

    fn mover(&self) -> zeropp_zero::device::NcclMover<'_> {
        zeropp_zero::device::NcclMover {
            world: &self.world,
            node: &self.node,
            cross: &self.cross,
            hpz: &self.node,
            members: [&[0], &[0], &[0], &[0]],
            rank: 0,
            layout: OneGpu::LAYOUT,
            counter: &self.counter,
            gpu: &self.gpu,
        }
    }
}

/// The device itself: one rank, NCCL communicators of one, against the
/// host library on the same gradients.
#[test]
#[ignore = "needs an NVIDIA GPU and NCCL: run cuda/check-on-gpu.sh"]
fn the_gpu_gives_the_host_librarys_qgz_bit_for_bit() {
    use zeropp_zero::device::DeviceValues;
    let case = CASES[0];
    let host = run(case, Host);
    let one = OneGpu::open();
    let (gpu, layout, mover) = (&one.gpu, OneGpu::LAYOUT, one.mover());
    let f4 = QuantFormat::int4(32).unwrap();
    let settings = Qgz {
        intra: qgz::FirstHop::Quantized(f4),
        inter: f4,
        rounding: Rounding::NearestEven,
        hadamard: false,
    };
    let (mut r1, mut r2) = (gpu.chunks(f4, 0, 0).unwrap(), gpu.chunks(f4, 0, 0).unwrap());
    for call in 0..case.calls {
        let grad = DeviceValues::Owned(gpu.upload(&gradient(case.chunk, 0, call)).unwrap());
        let feedback = Feedback {
            first: Some(&mut r1),
            second: Some(&mut r2),
        };
        let s = (settings, case.reduction);
        let out = qgz::reduce_scatter(gpu, &mover, layout, s, &grad, feedback).unwrap();
        let got = gpu.download(&out.view()).unwrap();
        assert_eq!(bits(&got), host[0].results[call], "call {call}");
        let (h1, h2) = &host[0].residuals[call];
        assert_eq!(&r1.to_host(gpu).unwrap(), h1, "call {call}: first residual");
        assert_eq!(
            &r2.to_host(gpu).unwrap(),
            h2,
            "call {call}: second residual"
        );
    }
}

/// qwZ on the device: one rank, against the host library.
#[test]
#[ignore = "needs an NVIDIA GPU and NCCL: run cuda/check-on-gpu.sh"]
fn the_gpu_gathers_qwz_as_the_host_library_does() {
    let host = gathers(1, 1, 1, 8, Host);
    let one = OneGpu::open();
    let (gpu, layout, mover) = (&one.gpu, OneGpu::LAYOUT, one.mover());
    let shard: Vec<half::bf16> = gradient(300, 0, 9)
        .into_iter()
        .map(half::bf16::from_f32)
        .collect();
    let ds = gpu.upload(&shard).unwrap();
    let f8 = QuantFormat::int8(256).unwrap();
    let all = qwz::gather_quantized::<_, _, half::bf16>(
        gpu,
        &mover,
        layout,
        &ds.as_view(),
        f8,
        Phase::ForwardGather,
    )
    .unwrap();
    let mut out = gpu.zeros::<half::bf16>(300).unwrap();
    qwz::dequantize_all::<_, half::bf16>(gpu, &all, |r| r, &mut out.as_view_mut()).unwrap();
    let got: Vec<u32> = gpu
        .download(&out.as_view())
        .unwrap()
        .iter()
        .map(|v| v.to_bits() as u32)
        .collect();
    assert_eq!(got, host[0].0);
}

/// FSDP2's calls as `zeropp.torch` makes them on the device
/// (`zero::fsdp`), one rank, bf16 tensors: the plain gather and
/// reduce-scatter (NCCL's own) give the input back, qwZ and qgZ give the
/// host library's bits.
#[test]
#[ignore = "needs an NVIDIA GPU and NCCL: run cuda/check-on-gpu.sh"]
fn the_gpu_runs_fsdp2s_calls_as_the_host_does() {
    use half::bf16;
    use zeropp_zero::Hop;
    use zeropp_zero::fsdp::{self, GradWire, WeightWire};
    let x: Vec<bf16> = gradient(1000, 0, 3)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let f8 = QuantFormat::int8(256).unwrap();
    let (intra, inter) = plan::gradient_formats(8, 32, Some(128)).unwrap();
    let qgz = GradWire::TwoHop {
        intra,
        inter,
        error_feedback: false,
        stochastic: false,
        hadamard: true,
    };
    fn none<Q: Quantizer>() -> (Rounding, Feedback<'static, Q>) {
        (Rounding::NearestEven, Feedback::none())
    }
    let phase = Phase::ForwardGather;
    let x2 = x.clone();
    let host = on_ranks(1, 1, 1, move |layout, m, _| {
        let (mut gathered, mut summed) = (vec![bf16::ZERO; 1000], vec![bf16::ZERO; 1000]);
        let how = WeightWire::Quantized(f8);
        let (i, mut o) = (&x2[..], &mut gathered[..]);
        fsdp::all_gather(&Host, m, layout, Hop::World, how, phase, None, &i, &mut o).unwrap();
        let (i, mut o) = (&x2[..], &mut summed[..]);
        let mean = Reduction::Mean;
        fsdp::reduce_scatter(&Host, m, layout, qgz, none(), mean, &i, &mut o).unwrap();
        (gathered, summed)
    });
    let one = OneGpu::open();
    let (gpu, layout, m) = (&one.gpu, OneGpu::LAYOUT, one.mover());
    let dx = gpu.upload(&x).unwrap();
    let mut out = gpu.zeros::<bf16>(1000).unwrap();
    let mut call = |gather: Option<WeightWire>, scatter: Option<GradWire>| {
        let (i, mut o) = (dx.as_view(), out.as_view_mut());
        match (gather, scatter) {
            (Some(how), _) => {
                fsdp::all_gather(gpu, &m, layout, Hop::World, how, phase, None, &i, &mut o)
            }
            (_, Some(wire)) => {
                let mean = Reduction::Mean;
                fsdp::reduce_scatter(gpu, &m, layout, wire, none(), mean, &i, &mut o)
            }
            _ => unreachable!(),
        }
        .unwrap();
        gpu.download(&out.as_view()).unwrap()
    };
    assert_eq!(call(Some(WeightWire::Bf16), None), x, "plain gather");
    let ring = GradWire::RingBf16;
    assert_eq!(call(None, Some(ring)), x, "plain reduce-scatter");
    assert_eq!(
        call(Some(WeightWire::Quantized(f8)), None),
        host[0].0,
        "qwZ"
    );
    assert_eq!(call(None, Some(qgz)), host[0].1, "qgZ");
}

/// qwZ on weight differences on the device, its references kept on the
/// device and in host memory (`frozen_cache="host"`), half of each shard
/// frozen: the same weights as the host library's, gather after gather,
/// and the references where they were asked for.
#[test]
#[ignore = "needs an NVIDIA GPU and NCCL: run cuda/check-on-gpu.sh"]
fn the_gpu_keeps_references_on_the_host_as_on_the_device() {
    use half::bf16;
    use zeropp_zero::Hop;
    use zeropp_zero::fsdp;
    let wire = zeropp_zero::fsdp::WeightWire::Delta(zeropp_zero::delta::DeltaWire {
        delta: plan::weight_format(4, 64).unwrap(),
        refresh_every: 100,
        fp32: false,
        hpz: true,
        bf16_references: false,
        int8_references: None,
    });
    let how = wire.for_call(true, true);
    let frozen: Vec<_> = std::iter::once(0..150).collect();
    let shards: Vec<Vec<bf16>> = (0..4)
        .map(|call| {
            let (w, d) = (gradient(300, 0, 9), gradient(300, 0, call));
            (0..300)
                .map(|i| bf16::from_f32(w[i] + if i < 150 { 0.0 } else { 1e-3 * d[i] }))
                .collect()
        })
        .collect();
    let phases = [Phase::ForwardGather, Phase::BackwardGather];
    let (host_shards, frozen_gpu) = (shards.clone(), frozen.clone());
    let host = on_ranks(1, 1, 1, move |layout, m, _| {
        let mut reference = None;
        let mut seen = Vec::new();
        for shard in &host_shards {
            for phase in phases {
                let mut out = vec![bf16::ZERO; 300];
                let slot = delta::Slot {
                    reference: &mut reference,
                    frozen: &frozen,
                    on_host: false,
                };
                let (i, mut o) = (&shard[..], &mut out[..]);
                fsdp::all_gather(
                    &Host,
                    m,
                    layout,
                    Hop::World,
                    how,
                    phase,
                    Some(slot),
                    &i,
                    &mut o,
                )
                .unwrap();
                seen.push(out);
            }
        }
        seen
    });
    let one = OneGpu::open();
    let (gpu, layout, m) = (&one.gpu, OneGpu::LAYOUT, one.mover());
    for on_host in [false, true] {
        let mut reference = None;
        let mut seen = Vec::new();
        for shard in &shards {
            let dx = gpu.upload(shard).unwrap();
            for phase in phases {
                let mut out = gpu.zeros::<bf16>(300).unwrap();
                let slot = delta::Slot {
                    reference: &mut reference,
                    frozen: &frozen_gpu,
                    on_host,
                };
                let (i, mut o) = (dx.as_view(), out.as_view_mut());
                fsdp::all_gather(
                    gpu,
                    &m,
                    layout,
                    Hop::World,
                    how,
                    phase,
                    Some(slot),
                    &i,
                    &mut o,
                )
                .unwrap();
                seen.push(gpu.download(&out.as_view()).unwrap());
            }
        }
        assert_eq!(seen, host[0], "references on the host: {on_host}");
        let kept = reference
            .as_ref()
            .and_then(|r| r.kept())
            .map(|k| k.on_host());
        assert_eq!(kept, Some(on_host), "where the references are kept");
    }
}

/// The CUDA device's queue (`zero::work` over `CudaQueue`): a launched
/// call returns with an event recorded after it on the caller's stream;
/// the wait is that stream waiting on it (the host goes on), the event
/// completes once the stream ran, and an error of the call is raised at
/// the wait.
#[test]
#[ignore = "needs an NVIDIA GPU and NCCL: run cuda/check-on-gpu.sh"]
fn on_cuda_a_launched_call_returns_with_an_event_the_callers_stream_waits_on() {
    use zeropp_cuda::Gpu;
    use zeropp_zero::ZeroError;
    use zeropp_zero::device::CudaQueue;
    use zeropp_zero::work::{Fail, Watchdog, Work};

    struct NeverStuck;
    impl Fail for NeverStuck {
        fn fail_stuck(&self, _: Duration) -> String {
            "stuck".into()
        }
    }
    let gpu = Arc::new(Gpu::open_shared(0).unwrap());
    let stream = gpu.context().new_stream().unwrap();
    let raw = stream.cu_stream() as usize;
    let queue = Arc::new(CudaQueue {
        ctx: gpu.context().clone(),
    });
    let job = Arc::new(NeverStuck);
    let watchdog = Watchdog::start(Arc::downgrade(&job), Duration::from_secs(10));
    // A copy big enough to be in flight when the call returns.
    let src = Arc::new(stream.clone_htod(&vec![1f32; 1 << 26]).unwrap());
    let copied = src.clone();
    let on = stream.clone();
    let call = move || {
        let mut dst = on.alloc_zeros::<f32>(copied.len()).unwrap();
        on.memcpy_dtod(&*copied, &mut dst).unwrap();
        Ok(())
    };
    // SAFETY: `stream` lives to the end of the test; the buffers live in
    // the call.
    let work = unsafe { Work::launch(&queue, raw, &watchdog, call) }.unwrap();
    unsafe { work.wait(raw) }.unwrap();
    stream.synchronize().unwrap();
    assert!(work.is_completed().unwrap());
    let failing = || Err(ZeroError::Invalid("bad input found by the call".into()));
    let work = unsafe { Work::launch(&queue, raw, &watchdog, failing) }.unwrap();
    let e = unsafe { work.wait(raw) }.unwrap_err().to_string();
    assert!(e.contains("bad input"), "{e}");
    drop(src);
}
