#!/usr/bin/env bash
# An emulated low-bandwidth cluster on one machine (run as root):
# N network namespaces ("nodes") joined by a bridge that lives in a switch
# namespace, each node's egress shaped by a token bucket (tc tbf), or by
# netem when --delay is given; G ranks per node talk over the node's
# loopback, across nodes over the veth links. For every (mode, rate) it runs
# `zeropp train` on that cluster and records step time, loss, the engine's
# count of bytes across nodes and the bytes the veth counters saw, in a CSV
# (and a PNG when matplotlib is available). With --probe it first measures
# what plain TCP gets through the shaped links (probe.csv). Everything it
# creates is removed on exit, on error or on ^C.
#
#   bench-cluster/run.sh --nodes 2 --ranks-per-node 2 --rates "20mbit 100mbit" \
#       --modes "zero3 zeropp" --steps 40 --probe "ring all" --out bench-cluster/results
#
# Modes: zero3, zeropp, or ZeRO-3 with one ZeRO++ switch: qwz (int8 weight
# gathers), hpz (node-local secondary shards), qgz (int4 two-hop gradients);
# beyond: zeropp with int4 weight differences and the Hadamard-rotated qgZ
# hop across nodes in blocks of 64 (docs/TRAINING.md).
# --delay D [--jitter J]: netem instead of tbf, each packet delayed D +- J
# (needs sch_netem; the delay column of the CSV reads D/J).
# Probe patterns: ring (each node to the next), all (each node to every
# other); --probe-flows F connections per peer, --probe-seconds S counted.
#
# PyTorch modes run examples/torch_gpt.py under torchrun on every node
# (--python PATH: the interpreter with torch and zeropp installed; default
# $ZEROPP_PYTHON or python3): torch-zeropp and torch-zero3 (FSDP2 with
# zeropp's communication; torch-beyond as beyond), torch-fsdp2 and
# torch-hsdp (FSDP2's own, over gloo), torch-zeropp-hsdp and
# torch-zero3-hsdp (zeropp on HSDP's 2-D mesh: FSDP2 sharded inside each
# node, its all-reduce across nodes through zeropp).
#
# --launcher starts the native modes' ranks with: zeropp (default:
# `zeropp launch --node-rank K` on every node), torchrun (`torchrun --nnodes
# N --node-rank K --no-python zeropp train` on every node, torchrun's store
# on node 0), or mpirun (one `mpirun` on node 0 whose rsh agent enters the
# other nodes' namespaces: --mca plm_rsh_agent); the CSV's mode reads
# MODE@LAUNCHER then.
#
# Extra arguments after `--` go to `zeropp train` or torch_gpt.py (model
# shape, batch, ...).
set -euo pipefail

NODES=2
RPN=2
RATES="50mbit"
MODES="zero3 zeropp"
STEPS=40
DELAY="0ms"
JITTER=""
OUT="bench-cluster/results"
PROBE=""
PROBE_FLOWS=1
PROBE_SECONDS=8
ZEROPP="${ZEROPP:-target/release/zeropp}"
PYTHON="${ZEROPP_PYTHON:-python3}"
LAUNCHER="zeropp"
EXTRA=()

die() { echo "bench-cluster: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) NODES="$2"; shift 2 ;;
    --ranks-per-node) RPN="$2"; shift 2 ;;
    --rates) RATES="$2"; shift 2 ;;
    --modes) MODES="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --delay) DELAY="$2"; shift 2 ;;
    --jitter) JITTER="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --zeropp) ZEROPP="$2"; shift 2 ;;
    --python) PYTHON="$2"; shift 2 ;;
    --probe) PROBE="$2"; shift 2 ;;
    --launcher) LAUNCHER="$2"; shift 2 ;;
    --probe-flows) PROBE_FLOWS="$2"; shift 2 ;;
    --probe-seconds) PROBE_SECONDS="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,41p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

[ "$(id -u)" -eq 0 ] || die "needs root to create network namespaces; run it with sudo"
command -v ip >/dev/null && command -v tc >/dev/null || die "needs iproute2 (ip, tc): apt-get install iproute2"
[ -x "$ZEROPP" ] || die "no zeropp binary at $ZEROPP: cargo build --release first (or pass --zeropp PATH)"
ZEROPP="$(cd "$(dirname "$ZEROPP")" && pwd)/$(basename "$ZEROPP")"
[ "$NODES" -ge 2 ] && [ "$NODES" -le 200 ] || die "--nodes must be between 2 and 200"
case "$LAUNCHER" in
  zeropp) ;;
  torchrun) "$PYTHON" -c "import torch" 2>/dev/null || die "--launcher torchrun: $PYTHON has no torch (pass --python)" ;;
  mpirun) command -v mpirun >/dev/null || die "--launcher mpirun: no mpirun (apt-get install openmpi-bin)" ;;
  *) die "unknown launcher $LAUNCHER: use zeropp, torchrun or mpirun" ;;
esac
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

HERE="$(cd "$(dirname "$0")" && pwd)"
NETNS_TAG="zpb$$"
NETNS_PREFIX=10.77.0
# shellcheck source=bench-cluster/netns.sh
. "$HERE/netns.sh"
node_ns() { netns_name "$1"; }
node_ip() { netns_ip "$1"; }
cleanup() { netns_down "$NODES"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# `zeropp train` flags of a mode: the two presets, or ZeRO-3 with one
# ZeRO++ switch on.
mode_args() {
  case "$1" in
    zero3|zeropp) echo "--mode $1" ;;
    qwz) echo "--mode zero3 --qwz-bits 8" ;;
    hpz) echo "--mode zero3 --hpz true" ;;
    qgz) echo "--mode zero3 --qgz true" ;;
    # zeropp's default since 2026-12-02, spelled out.
    beyond) echo "--mode zeropp --qwz-bits 4 --qwz-delta true --qgz-hadamard true --qgz-inter-block 64" ;;
    # DeepSpeed's ZeRO++ as published (zeropp's default before 2026-12-02).
    published) echo "--mode zeropp --qwz-delta false --qgz-hadamard false --qgz-inter-block 32" ;;
    torch-zeropp|torch-zero3|torch-fsdp2|torch-hsdp) echo "--mode ${1#torch-} --bf16" ;;
    torch-beyond) echo "--mode zeropp --bf16 --switch qwz_bits=4 --switch qwz_delta=true --switch qgz_hadamard=true --switch qgz_inter_block=64" ;;
    torch-published) echo "--mode zeropp --bf16 --switch qwz_delta=false --switch qgz_hadamard=false --switch qgz_inter_block=null" ;;
    # FSDP2 with zeropp's communication on HSDP's 2-D mesh (sharded inside
    # each node, replicated across nodes: its all-reduce through zeropp).
    torch-zeropp-hsdp|torch-zero3-hsdp) m="${1#torch-}"; echo "--mode ${m%-hsdp} --mesh hsdp --bf16" ;;
    *) die "unknown mode $1: use zero3, zeropp, qwz, hpz, qgz, beyond, published or torch-{zeropp,zero3,fsdp2,hsdp,beyond,published,zeropp-hsdp,zero3-hsdp}" ;;
  esac
}
for m in $MODES; do mode_args "$m" >/dev/null; done
case " $MODES " in
  *" torch-"*)
    "$PYTHON" -c "import torch, zeropp.torch" 2>/dev/null ||
      die "$PYTHON cannot import torch and zeropp.torch: pip install torch ./python (or pass --python)" ;;
esac
EXAMPLE="$(cd "$(dirname "$0")/.." && pwd)/examples/torch_gpt.py"

rate_bps() { netns_rate_bps "$1"; }

build_cluster() {
  local rate="$1"
  cleanup
  netns_up "$NODES"
  for k in $(seq 0 $((NODES - 1))); do
    local ns; ns="$(node_ns "$k")"
    # The node's NIC: its egress shaped to the link rate (a token bucket with
    # 10 ms of burst), or netem when a delay is asked for.
    if [ -z "$JITTER" ] && { [ "$DELAY" = "0ms" ] || [ "$DELAY" = "0" ]; }; then
      netns_tbf "$k" "$rate"
    else
      # shellcheck disable=SC2086 # JITTER is empty or one word
      tc -n "$ns" qdisc add dev eth0 root netem rate "$rate" delay "$DELAY" $JITTER limit 100000 ||
        die "this kernel has no netem (sch_netem; modprobe sch_netem): run without --delay/--jitter"
    fi
  done
}

# Sum of a counter of eth0 over the nodes.
counter() { netns_counter "$NODES" "$1"; }

# What the shaped links deliver to plain TCP (bench-cluster/probe.py), with
# the flows of a pattern: ring (each node to the next, like a ring
# collective's one cross-node hop) or all (each node to every other, like
# qgZ's all-to-all). Appends a row per pattern to probe.csv and prints it.
PROBE_CSV="$OUT/probe.csv"
probe_link() {
  local rate="$1" pattern="$2" start k to
  # Every node starts sending at the same epoch second: far enough ahead
  # for each node's Python to start and connect on a loaded machine.
  start=$(( $(date +%s) + 5 ))
  local pids=()
  for k in $(seq 0 $((NODES - 1))); do
    case "$pattern" in
      ring) to="$(node_ip $(((k + 1) % NODES)))" ;;
      *) to="$(for j in $(seq 0 $((NODES - 1))); do [ "$j" -eq "$k" ] || printf '%s,' "$(node_ip "$j")"; done)" ;;
    esac
    ip netns exec "$(node_ns "$k")" python3 "$HERE/probe.py" --node "$k" --listen "$(node_ip "$k")" \
      --to "$to" --flows "$PROBE_FLOWS" --start "$start" --seconds "$PROBE_SECONDS" \
      > "$OUT/probe-$pattern-${NODES}n-$rate-node$k.json" 2>&1 &
    pids+=($!)
  done
  local failed=0 p
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  [ "$failed" -eq 0 ] || die "link probe failed; see $OUT/probe-$pattern-${NODES}n-$rate-node*.json"
  python3 - "$rate" "$pattern" "$PROBE_FLOWS" "$NODES" "$(rate_bps "$rate")" \
    "$OUT/probe-$pattern-${NODES}n-$rate-node"*.json >> "$PROBE_CSV" <<'PY'
import json, sys
rate, pattern, flows, nodes = sys.argv[1:5]
nominal = int(sys.argv[5]) / 1e6
runs = [json.load(open(f)) for f in sys.argv[6:]]
# A node's egress: what every other node received from its address.
egress = {}
for r in runs:
    for src, b in r["from"].items():
        egress[src] = egress.get(src, 0) + b
window = runs[0]["window_s"]
mbit = sorted(8 * b / window / 1e6 for b in egress.values())
mean = sum(mbit) / len(mbit)
print(f"{rate},{nodes},{pattern},{flows},{window:g},{mean:.3f},{mbit[0]:.3f},{mbit[-1]:.3f},{mean / nominal:.3f}")
PY
  echo "probe: $(tail -n 1 "$PROBE_CSV")" >&2
}

CSV="$OUT/results.csv"
RUN_START=0
[ -f "$CSV" ] && RUN_START=$(( $(wc -l < "$CSV") - 1 ))
[ -f "$CSV" ] || echo "mode,nodes,ranks_per_node,rate,delay,steps,median_step_s,tokens_per_s,final_loss,val_loss,engine_inter_bytes,wire_inter_bytes,wire_vs_engine" > "$CSV"

[ -f "$PROBE_CSV" ] || [ -z "$PROBE" ] || echo "rate,nodes,pattern,flows_per_peer,window_s,mean_egress_mbit,min_egress_mbit,max_egress_mbit,mean_vs_nominal" > "$PROBE_CSV"
for p in $PROBE; do case "$p" in ring|all) ;; *) die "unknown probe pattern $p: use ring or all" ;; esac; done
for rate in $RATES; do rate_bps "$rate" >/dev/null || exit 1; done

for rate in $RATES; do
  if [ -n "$PROBE" ]; then
    build_cluster "$rate"
    for pattern in $PROBE; do probe_link "$rate" "$pattern"; done
  fi
  for mode in $MODES; do
    build_cluster "$rate"
    label="$mode"
    case "$mode" in torch-*) ;; *) [ "$LAUNCHER" = zeropp ] || label="$mode@$LAUNCHER" ;; esac
    name="$label-${NODES}x$RPN-$rate"
    token="$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    bytes0=$(counter tx_bytes); packets0=$(counter tx_packets)
    pids=()
    for k in $(seq 0 $((NODES - 1))); do
      case "$mode" in
        torch-*)
          # torchrun's own store on node 0; gloo and zeropp find their
          # addresses through it (eth0: the shaped link).
          ip netns exec "$(node_ns "$k")" env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
            "$PYTHON" -m torch.distributed.run --nnodes "$NODES" --node-rank "$k" \
            --nproc-per-node "$RPN" --master-addr "$(node_ip 0)" --master-port 29500 \
            "$EXAMPLE" $(mode_args "$mode") --steps "$STEPS" --log-every 10 \
            --summary-json "$OUT/$name.json" --metrics "$OUT/$name.jsonl" "${EXTRA[@]}" \
            > "$OUT/$name-node$k.log" 2>&1 &
          ;;
        *)
          train=("$ZEROPP" train $(mode_args "$mode") --steps "$STEPS" --log-every 10
            --summary-json "$OUT/$name.json" --metrics "$OUT/$name.jsonl" "${EXTRA[@]}")
          case "$LAUNCHER" in
            zeropp)
              ip netns exec "$(node_ns "$k")" env ZEROPP_TOKEN="$token" "$ZEROPP" launch \
                --nodes "$NODES" --ranks-per-node "$RPN" --node-rank "$k" --master-addr "$(node_ip 0):29500" \
                --timeout 300 -- "${train[@]}" > "$OUT/$name-node$k.log" 2>&1 &
              ;;
            torchrun)
              # zeropp joins through torchrun's store: no token, no port of its own.
              ip netns exec "$(node_ns "$k")" env OMP_NUM_THREADS=1 ZEROPP_TIMEOUT_S=300 \
                "$PYTHON" -m torch.distributed.run --nnodes "$NODES" --node-rank "$k" \
                --nproc-per-node "$RPN" --master-addr "$(node_ip 0)" --master-port 29500 \
                --no-python "${train[@]}" > "$OUT/$name-node$k.log" 2>&1 &
              ;;
            mpirun)
              # One mpirun, on node 0; its rsh agent starts Open MPI's daemon
              # on the other nodes by entering their namespaces.
              if [ "$k" -eq 0 ]; then
                agent="$OUT/rsh-agent"
                hosts="$OUT/hostfile"
                { echo '#!/bin/sh'
                  echo 'host="$1"; shift'
                  echo 'case "$host" in'
                  for j in $(seq 0 $((NODES - 1))); do echo "  $(node_ip "$j")) ns=$(node_ns "$j") ;;"; done
                  echo '  *) echo "rsh agent: unknown host $host" >&2; exit 1 ;;'
                  echo 'esac'
                  echo 'exec ip netns exec "$ns" sh -c "$*"'
                } > "$agent"
                chmod +x "$agent"
                for j in $(seq 0 $((NODES - 1))); do echo "$(node_ip "$j") slots=$RPN"; done > "$hosts"
                ip netns exec "$(node_ns 0)" env ZEROPP_TOKEN="$token" ZEROPP_TIMEOUT_S=300 \
                  MASTER_ADDR="$(node_ip 0)" MASTER_PORT=29500 \
                  mpirun --allow-run-as-root --oversubscribe -np $((NODES * RPN)) --hostfile "$hosts" \
                  --mca plm_rsh_agent "$agent" --mca oob_tcp_if_include eth0 --mca btl_tcp_if_include eth0 \
                  -x ZEROPP_TOKEN -x ZEROPP_TIMEOUT_S -x MASTER_ADDR -x MASTER_PORT -x PATH \
                  "${train[@]}" > "$OUT/$name-node0.log" 2>&1 &
              else
                continue
              fi
              ;;
          esac
          ;;
      esac
      pids+=($!)
    done
    failed=0
    for p in "${pids[@]}"; do wait "$p" || failed=1; done
    [ "$failed" -eq 0 ] || die "run $name failed; see $OUT/$name-node*.log"
    bytes=$(( $(counter tx_bytes) - bytes0 )); packets=$(( $(counter tx_packets) - packets0 ))
    # Ethernet (14) + IPv4 (20) + TCP with timestamps (32) per packet.
    wire=$((bytes - 66 * packets))
    python3 - "$OUT/$name.json" "$wire" "$label" "$NODES" "$RPN" "$rate" "$DELAY${JITTER:+/$JITTER}" "$STEPS" >> "$CSV" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
wire = int(sys.argv[2])
mode, nodes, rpn, rate, delay, steps = sys.argv[3:9]
if "run_bytes" in s:
    # What zeropp handed to its transport across nodes, plus its 40-byte frame headers.
    engine = s["run_bytes"]["inter_node"] + 40 * s["run_messages"]["inter_node"]
elif s["bytes_per_step"]["inter_node"] is not None:
    # torch_gpt.py: zeropp's count over the training steps only.
    engine = s["bytes_per_step"]["inter_node"] * int(steps)
else:
    engine = None  # FSDP2's own collectives: only the wire counts them
vs = f"{wire / engine - 1:+.3%}" if engine else ""
print(f"{mode},{nodes},{rpn},{rate},{delay},{steps},{s['median_step_time_s']:.4f},{s['tokens_per_s']:.1f},"
      f"{s['final_loss']:.4f},{s['val_loss']:.4f},{engine or 0:.0f},{wire},{vs}")
PY
    tail -n 1 "$CSV"
  done
done

# Step time against the peer a user would pick instead, measured in this
# run: each mode against zero3 (the native trainer) or torch-fsdp2 (PyTorch).
python3 - "$CSV" "$RUN_START" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1]))][int(sys.argv[2]):]
def key(r):
    return (r["rate"], r["nodes"], r["ranks_per_node"], r["delay"])
for k in dict.fromkeys(key(r) for r in rows):
    here = {r["mode"]: float(r["median_step_s"]) for r in rows if key(r) == k}
    for peer in ("zero3", "torch-fsdp2", "torch-hsdp"):
        if peer not in here:
            continue
        others = [f"{m} {t / here[peer]:.3f}x" for m, t in here.items() if m != peer]
        if others:
            print(f"{k[0]} {k[1]}x{k[2]}: step time vs {peer}: " + ", ".join(others))
PY

# A plot of step time against link rate, one line per mode.
if python3 -c "import matplotlib" 2>/dev/null; then
  python3 - "$CSV" "$OUT/step_time.png" <<'PY'
import csv, re, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
rows = list(csv.DictReader(open(sys.argv[1])))
def mbit(r):
    m = re.match(r"([0-9.]+)([kmg]?)bit", r.lower())
    return float(m.group(1)) * {"k": 1e-3, "": 1e-6, "m": 1, "g": 1e3}[m.group(2)]
fig, ax = plt.subplots(figsize=(6, 4))
for key in sorted({(r["mode"], r["nodes"], r["ranks_per_node"]) for r in rows}):
    pts = sorted((mbit(r["rate"]), float(r["median_step_s"])) for r in rows if (r["mode"], r["nodes"], r["ranks_per_node"]) == key)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} {key[1]}x{key[2]}")
ax.set_xscale("log"); ax.set_xlabel("link rate per node (Mbit/s)"); ax.set_ylabel("median step time (s)")
ax.legend(); ax.grid(True, alpha=0.3); fig.tight_layout(); fig.savefig(sys.argv[2], dpi=120)
PY
  echo "plot: $OUT/step_time.png"
else
  echo "no matplotlib: skipped the plot (python3 -m pip install matplotlib)"
fi
echo "results: $CSV"
