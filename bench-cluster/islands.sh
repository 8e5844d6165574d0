#!/usr/bin/env bash
# Islands on the emulated cluster (run as root): N network namespaces
# ("nodes", one island each) whose egress is shaped by a token bucket, as
# bench-cluster/run.sh builds them. For every rate it runs, with the same
# model, data, seed and per-rank batch:
#   sync     zeropp train on the whole job (synchronous ZeRO++)
#   alone    one island training alone (node 0 only)
#   apart    every island training at once but never syncing (--sync-every
#            beyond the steps): the step time islands aim at when the slow
#            link is hidden, under the same load on this machine's cores
#            as the islands' runs (on one machine the islands share them)
#   H        zeropp train --islands N --sync-every H, for each H of --syncs
#   SH       the same streamed: --stream "F D" gives --outer-fragments F
#            --outer-delay D (row `streamed`)
# and, with PyTorch (--python, --torchft-python), on examples/torch_gpt.py's
# GPT with the same H values:
#   torch-sync     torch_gpt.py, zeropp.torch on the whole job
#   torch-H        torch_gpt.py --islands N (zeropp.torch.OuterSync)
#   torch-SH       the same streamed (--stream "F D", row `torch-streamed`)
#   torchft-H      bench-cluster/torchft_diloco.py: torchft's DiLoCo, FSDP2 in
#                  each island over gloo, a lighthouse on node 0
#   kill           the first H of --syncs over TCP with `zeropp launch
#                  --islands N --restarts 1`: island 1's first rank is
#                  SIGKILLed a third of the way in; it prints (and writes to
#                  kill.txt) island 0's longest step, the seconds from the
#                  kill to the restart and from the restart to training
#                  again, and the summary's lost/rejoined islands
#   torch-kill     torch_gpt.py --islands N at the first H of --syncs under
#                  `zeropp launch --islands N --restarts 1` (zeropp.torch's
#                  init_islands and OuterSync): the first rank of island
#                  --kill-island (default 1; 0: global rank 0, whose
#                  launcher holds the job's store) SIGKILLed a third of the
#                  way in; the other islands' longest step, the seconds
#                  from the kill to the restart and from the restarted
#                  ranks' start to their rejoin, the islands lost and
#                  rejoined
# and appends to islands.csv the mean wall time per step (total / steps,
# syncs included), the losses (final: last 10 steps; validation: held-out
# text after the last outer sync), the engine's bytes across nodes (all, and
# the outer syncs') and what the veth counters saw. Then it prints each row
# against `alone` (step time) and `sync` (bytes, validation loss).
#
#   bench-cluster/islands.sh --nodes 2 --ranks-per-node 2 --rates "30mbit 10mbit" \
#       --syncs "10 20 50 100" --steps 100 --out /tmp/islands \
#       -- --width 384 --layers 2 --heads 6 --context 32 --batch 2
#
# Rows (--rows): any of sync alone apart islands streamed torch-sync
# torch-islands torch-streamed torchft kill torch-kill.
# Arguments after `--` go to every run (zeropp train, torch_gpt.py and
# torchft_diloco.py take the same model flags); --outer "--outer-lr 0.3
# --outer-momentum 0.7" to every islands run (every one takes these).
set -euo pipefail

NODES=2
RPN=2
RATES="30mbit"
SYNCS="20"
ROWS="sync alone islands"
STEPS=100
OUT="bench-cluster/results-islands"
ZEROPP="${ZEROPP:-target/release/zeropp}"
PYTHON="${ZEROPP_PYTHON:-python3}"
TFT_PYTHON="/tmp/tft-venv/bin/python"
OUTER=""
STREAM="4 2"
EXTRA=()
LAUNCH_FLAGS=()
KILL_RANK=""
KILL_ISLAND=1
# What the kill looks for among the processes: a rank of this command.
KILL_COMMAND=""

die() { echo "bench-cluster/islands: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) NODES="$2"; shift 2 ;;
    --ranks-per-node) RPN="$2"; shift 2 ;;
    --rates) RATES="$2"; shift 2 ;;
    --syncs) SYNCS="$2"; shift 2 ;;
    --rows) ROWS="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --zeropp) ZEROPP="$2"; shift 2 ;;
    --python) PYTHON="$2"; shift 2 ;;
    --torchft-python) TFT_PYTHON="$2"; shift 2 ;;
    --outer) OUTER="$2"; shift 2 ;;
    --stream) STREAM="$2"; shift 2 ;;
    --kill-island) KILL_ISLAND="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[ "$(id -u)" -eq 0 ] || die "needs root (network namespaces and tc)"
[ -x "$ZEROPP" ] || die "no zeropp binary at $ZEROPP (cargo build --release, or --zeropp PATH)"
ZEROPP="$(cd "$(dirname "$ZEROPP")" && pwd)/$(basename "$ZEROPP")"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

HERE="$(cd "$(dirname "$0")" && pwd)"
EXAMPLE="$HERE/../examples/torch_gpt.py"
NETNS_TAG="zpi$$"
NETNS_PREFIX=10.78.0
# shellcheck source=bench-cluster/netns.sh
. "$HERE/netns.sh"
cleanup() { netns_down "$NODES"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

build_cluster() {
  cleanup
  netns_up "$NODES"
  for k in $(seq 0 $((NODES - 1))); do netns_tbf "$k" "$1"; done
}

counter() { netns_counter "$NODES" "$1"; }

CSV="$OUT/islands.csv"
RUN_START=0
[ -f "$CSV" ] && RUN_START=$(( $(wc -l < "$CSV") - 1 ))
[ -f "$CSV" ] || echo "row,rate,nodes,ranks_per_node,sync_every,steps,mean_step_s,median_step_s,final_loss,val_loss,engine_inter_bytes,outer_bytes,wire_inter_bytes" > "$CSV"

# run KIND ROW RATE NODES FLAGS...: one job on the first NODES nodes; KIND
# is native (zeropp train), torch (torch_gpt.py under torchrun) or torchft.
run() {
  local kind="$1" row="$2" rate="$3" nodes="$4"; shift 4
  local name="$row-$rate" token k pids=() failed=0 lighthouse=""
  token="$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  local bytes0 packets0
  # A kill waits on this run's metrics, not an earlier run's.
  rm -f "$OUT/$name.jsonl" "$OUT/$name-killed-at"
  bytes0=$(counter tx_bytes); packets0=$(counter tx_packets)
  local out=(--steps "$STEPS" --log-every 10 --summary-json "$OUT/$name.json" --metrics "$OUT/$name.jsonl")
  if [ "$kind" = torchft ]; then
    ip netns exec "$(netns_name 0)" "$(dirname "$TFT_PYTHON")/torchft_lighthouse" --min_replicas "$nodes" \
      --quorum_tick_ms 100 --join_timeout_ms 10000 --bind "[::]:29510" > "$OUT/$name-lighthouse.log" 2>&1 &
    lighthouse=$!
  fi
  for k in $(seq 0 $((nodes - 1))); do
    local ns; ns="$(netns_name "$k")"
    case "$kind" in
      native)
        ip netns exec "$ns" env ZEROPP_TOKEN="$token" "$ZEROPP" launch \
          --nodes "$nodes" --ranks-per-node "$RPN" --node-rank "$k" --master-addr "$(netns_ip 0):29500" \
          --timeout 300 "${LAUNCH_FLAGS[@]}" -- "$ZEROPP" train "${out[@]}" "$@" "${EXTRA[@]}" \
          > "$OUT/$name-node$k.log" 2>&1 & ;;
      torch-launch)
        # Under zeropp launch: a failed rank stops its island only.
        ip netns exec "$ns" env ZEROPP_TOKEN="$token" GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
          ZEROPP_TIMEOUT_S=300 "$ZEROPP" launch --nodes "$nodes" --ranks-per-node "$RPN" \
          --node-rank "$k" --master-addr "$(netns_ip 0):29500" --timeout 300 "${LAUNCH_FLAGS[@]}" \
          -- "$PYTHON" "$EXAMPLE" --bf16 "${out[@]}" "$@" "${EXTRA[@]}" \
          > "$OUT/$name-node$k.log" 2>&1 & ;;
      torch)
        ip netns exec "$ns" env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 ZEROPP_TIMEOUT_S=300 \
          "$PYTHON" -m torch.distributed.run --nnodes "$nodes" --node-rank "$k" \
          --nproc-per-node "$RPN" --master-addr "$(netns_ip 0)" --master-port 29500 \
          "$EXAMPLE" --bf16 "${out[@]}" "$@" "${EXTRA[@]}" > "$OUT/$name-node$k.log" 2>&1 & ;;
      torchft)
        ip netns exec "$ns" env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 RUST_LOG=warn \
          TORCHFT_LIGHTHOUSE="http://$(netns_ip 0):29510" REPLICA_GROUP_ID="$k" NUM_REPLICA_GROUPS="$nodes" \
          "$TFT_PYTHON" -m torch.distributed.run --nnodes 1 --nproc-per-node "$RPN" \
          --master-addr 127.0.0.1 --master-port $((29600 + k)) "$HERE/torchft_diloco.py" \
          --advertise-host "$(netns_ip "$k")" --bf16 "${out[@]}" "$@" "${EXTRA[@]}" \
          > "$OUT/$name-node$k.log" 2>&1 & ;;
    esac
    pids+=($!)
  done
  if [ -n "${KILL_RANK:-}" ]; then
    # A third of the way in, SIGKILL rank KILL_RANK of this job.
    (
      while :; do
        n="$(grep -c '"step"' "$OUT/$name.jsonl" 2>/dev/null || true)"
        [ "${n:-0}" -lt $((STEPS / 3)) ] || break
        sleep 0.1
      done
      for p in $(pgrep -f "$KILL_COMMAND"); do
        env_of="$(tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null || true)"
        if grep -qx "RANK=$KILL_RANK" <<< "$env_of" && grep -qx "ZEROPP_TOKEN=$token" <<< "$env_of"; then
          date +%s.%N > "$OUT/$name-killed-at"; kill -9 "$p"
        fi
      done
    ) &
  fi
  for p in "${pids[@]}"; do
    wait "$p" || failed=1
  done
  [ -z "$lighthouse" ] || kill "$lighthouse" 2>/dev/null || true
  [ "$failed" -eq 0 ] || die "run $name failed; see $OUT/$name-node*.log"
  local bytes packets
  bytes=$(( $(counter tx_bytes) - bytes0 )); packets=$(( $(counter tx_packets) - packets0 ))
  python3 - "$OUT/$name.json" "$((bytes - 66 * packets))" "$row" "$rate" "$nodes" "$RPN" "$STEPS" >> "$CSV" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
wire, (row, rate, nodes, rpn, steps) = int(sys.argv[2]), sys.argv[3:8]
if "run_bytes" in s:
    engine = s["run_bytes"]["inter_node"] + 40 * s["run_messages"]["inter_node"]
else:
    engine = 0  # torchft: only the wire counts its bytes
isl = s.get("islands") or {}
if isinstance(isl, int):  # torchft's summary: the island count
    isl = {"sync_every": s.get("sync_every", "")}
print(f"{row},{rate},{nodes},{rpn},{isl.get('sync_every', '')},{steps},{s['mean_step_time_s']:.4f},"
      f"{s['median_step_time_s']:.4f},{s['final_loss']:.4f},{s['val_loss']:.4f},{engine:.0f},"
      f"{isl.get('outer_bytes', 0):.0f},{wire}")
PY
  tail -n 1 "$CSV"
}

for rate in $RATES; do
  for row in $ROWS; do
    case "$row" in
      sync) build_cluster "$rate"; run native sync "$rate" "$NODES" ;;
      alone) build_cluster "$rate"; run native alone "$rate" 1 ;;
      apart) build_cluster "$rate"; run native apart "$rate" "$NODES" --islands "$NODES" --sync-every 1000000 ;;
      islands)
        for h in $SYNCS; do
          build_cluster "$rate"
          # shellcheck disable=SC2086 # OUTER is flags
          run native "H$h" "$rate" "$NODES" --islands "$NODES" --sync-every "$h" $OUTER
        done ;;
      streamed)
        read -r frags delay <<< "$STREAM"
        for h in $SYNCS; do
          build_cluster "$rate"
          # shellcheck disable=SC2086
          run native "S$h" "$rate" "$NODES" --islands "$NODES" --sync-every "$h" \
            --outer-fragments "$frags" --outer-delay "$delay" $OUTER
        done ;;
      torch-sync) build_cluster "$rate"; run torch torch-sync "$rate" "$NODES" ;;
      torch-islands)
        for h in $SYNCS; do
          build_cluster "$rate"
          # shellcheck disable=SC2086
          run torch "torch-H$h" "$rate" "$NODES" --islands "$NODES" --sync-every "$h" $OUTER
        done ;;
      torch-streamed)
        read -r frags delay <<< "$STREAM"
        for h in $SYNCS; do
          build_cluster "$rate"
          # shellcheck disable=SC2086
          run torch "torch-S$h" "$rate" "$NODES" --islands "$NODES" --sync-every "$h" \
            --outer-fragments "$frags" --outer-delay "$delay" $OUTER
        done ;;
      torchft)
        for h in $SYNCS; do
          build_cluster "$rate"
          # shellcheck disable=SC2086
          run torchft "torchft-H$h" "$rate" "$NODES" --sync-every "$h" $OUTER
        done ;;
      kill)
        h="${SYNCS%% *}"
        build_cluster "$rate"
        LAUNCH_FLAGS=(--islands "$NODES" --restarts 1) KILL_RANK="$RPN" KILL_COMMAND="$ZEROPP train"
        # shellcheck disable=SC2086
        run native "kill-H$h" "$rate" "$NODES" --islands "$NODES" --sync-every "$h" --transport tcp $OUTER
        LAUNCH_FLAGS=() KILL_RANK=""
        python3 - "$OUT" "kill-H$h-$rate" >> "$OUT/kill.txt" <<'PY'
import datetime, json, re, sys
out, name = sys.argv[1:3]
killed = float(open(f"{out}/{name}-killed-at").read())
log = open(f"{out}/{name}-node1.log").read()
def when(pattern):
    m = re.search(r"(\d{4}-\d\d-\d\dT[\d:.]+)Z\S*\s+\S*\s*\S*" + pattern, log)
    return datetime.datetime.fromisoformat(m.group(1)).replace(tzinfo=datetime.timezone.utc).timestamp() if m else None
restart, back = when(".*restarting the ranks of island 1"), when(".*islands: rejoined from rank")
steps = [json.loads(l) for l in open(f"{out}/{name}.jsonl") if '"step"' in l]
s = json.load(open(f"{out}/{name}.json"))
isl = s["islands"]
print(f"{name}: island 0's longest step {max(x['step_time_s'] for x in steps):.2f} s; "
      f"restart {restart - killed:.1f} s after the kill, training again {back - restart:.1f} s after the restart; "
      f"lost {[(l['island'], l['after_step']) for l in isl['lost']]}, rejoined "
      f"{[(r['island'], r['after_step']) for r in isl['rejoined']]}; {s['steps']} steps, final loss "
      f"{s['final_loss']:.4f}, validation {s['val_loss']:.4f}")
PY
        tail -n 1 "$OUT/kill.txt" ;;
      torch-kill)
        h="${SYNCS%% *}"
        build_cluster "$rate"
        LAUNCH_FLAGS=(--islands "$NODES" --restarts 1) KILL_RANK=$((KILL_ISLAND * RPN)) KILL_COMMAND="$EXAMPLE"
        # shellcheck disable=SC2086
        run torch-launch "torch-kill-H$h" "$rate" "$NODES" --islands "$NODES" --sync-every "$h" $OUTER
        LAUNCH_FLAGS=() KILL_RANK=""
        python3 - "$OUT" "torch-kill-H$h-$rate" "$KILL_ISLAND" "$NODES" >> "$OUT/kill.txt" <<'PY'
import datetime, json, re, sys
out, name, lost_island, nodes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
killed = float(open(f"{out}/{name}-killed-at").read())
log = "".join(open(f"{out}/{name}-node{k}.log").read() for k in range(nodes))
m = re.search(r"(\d{4}-\d\d-\d\dT[\d:.]+)Z\S*\s+\S*\s*\S*.*restarting the ranks of island " + str(lost_island), log)
restart = datetime.datetime.fromisoformat(m.group(1)).replace(tzinfo=datetime.timezone.utc).timestamp() if m else None
back = [float(x) for x in re.findall(r"rejoined after step \d+, ([\d.]+) s after this rank started", log)]
# Global rank 0's metrics (a restarted rank 0 appends after the step it rejoined after).
steps = [json.loads(l) for l in open(f"{out}/{name}.jsonl") if '"step"' in l]
s = json.load(open(f"{out}/{name}.json"))
isl = s["islands"]
weights = dict(re.findall(r"island (\d) weights (\S+)", log))
longest = {int(i): float(t) for i, t in re.findall(r"island (\d) longest step (\S+) s", log)}
others = max((t for i, t in longest.items() if i != lost_island), default=float("nan"))
print(f"{name}: island {lost_island} killed; the others' longest step {others:.2f} s "
      f"(rank 0's median {sorted(x['step_time_s'] for x in steps)[len(steps) // 2]:.3f} s); "
      f"restart {restart - killed:.1f} s after the kill, rejoined {max(back, default=float('nan')):.1f} s "
      f"after its ranks started; lost {[(l['island'], l['step']) for l in isl['lost']]}, rejoined "
      f"{[(r['island'], r['step']) for r in isl['rejoined']]}; islands' weights alike: "
      f"{len(set(weights.values())) == 1 and len(weights) == nodes}; rank 0 logged {len(steps)} "
      f"steps, final loss {s['final_loss']:.4f}, validation {s['val_loss']:.4f}")
PY
        tail -n 1 "$OUT/kill.txt" ;;
      *) die "unknown row $row: use sync, alone, apart, islands, streamed, torch-sync, torch-islands, torch-streamed, torchft, kill, torch-kill" ;;
    esac
  done
done

# Each row against one island alone (step time) and synchronous zeropp
# (bytes across nodes, validation loss), measured in this invocation.
python3 - "$CSV" "$RUN_START" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))[int(sys.argv[2]):]
for rate in dict.fromkeys(r["rate"] for r in rows):
    here = {r["row"]: r for r in rows if r["rate"] == rate}
    alone, sync = here.get("apart") or here.get("alone"), here.get("sync")
    for name, r in here.items():
        parts = [f"{rate} {name}: {float(r['mean_step_s']):.4f} s/step"]
        if alone:
            which = "apart" if "apart" in here else "alone"
            parts.append(f"{float(r['mean_step_s']) / float(alone['mean_step_s']):.3f}x {which}'s step")
        if sync and name not in ("alone", "apart"):
            parts.append(f"{int(r['wire_inter_bytes']) / max(int(sync['wire_inter_bytes']), 1):.4f}x sync's wire bytes")
            parts.append(f"validation {float(r['val_loss']):.4f} ({float(r['val_loss']) / float(sync['val_loss']) - 1:+.2%} vs sync)")
        print(", ".join(parts))
    # The peer a PyTorch user would pick instead: torchft's DiLoCo at the same H.
    for name, r in here.items():
        peer = here.get("torchft-" + name.removeprefix("torch-"))
        if peer is None or name.startswith("torchft"):
            continue
        t, tp = float(r["mean_step_s"]), float(peer["mean_step_s"])
        w, wp = int(r["wire_inter_bytes"]), max(int(peer["wire_inter_bytes"]), 1)
        print(f"{rate} {name} vs torchft: step {t / tp:.3f}x, wire bytes {w / wp:.4f}x, "
              f"validation {float(r['val_loss']):.4f} vs {float(peer['val_loss']):.4f}")
PY
echo "results: $CSV"
