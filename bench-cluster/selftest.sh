#!/usr/bin/env bash
# A short run of the emulated cluster (root): 2 nodes x 2 ranks on a shaped
# link, a 3-second TCP probe of the shaped link (it must deliver data and
# no more than the rate it is shaped to, or the shaping is not in place),
# one tiny zeropp training run (started by `zeropp launch --node-rank`,
# then by mpirun and torchrun across the emulated hosts); checks that the
# engine's byte count
# and the veth counters agree within 5% (10 steps, so UCX's fixed wire-up
# traffic is under 1%; two ranks per node: node-local
# shared memory must not carry cross-node traffic), that `--islands auto`
# cuts the job at 30 Mbit/s and not at 10 Gbit/s (and that a run without it
# says the plan would), and that nothing is left behind.
# With a Python that has torch and zeropp (second argument), it also runs
# examples/torch_gpt.py under torchrun on the cluster: plain FSDP2 over
# gloo, and ZeRO-3 and ZeRO++ through zeropp.torch (bf16): zeropp's count
# and the veth counters must agree within 5%, and ZeRO++'s bytes across
# nodes on the wire must be at most 0.27x plain FSDP2's.
# CI runs it after the test suite; run it by hand with sudo.
set -euo pipefail
cd "$(dirname "$0")/.."
zeropp="${1:-target/debug/zeropp}"
python="${2:-}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
bash bench-cluster/run.sh --nodes 2 --ranks-per-node 2 --rates 200mbit --modes zeropp --steps 10 \
  --probe ring --probe-seconds 3 \
  --zeropp "$zeropp" --out "$out" -- --width 32 --layers 1 --heads 2 --context 32 --batch 2 --val-batches 1 \
  >/dev/null 2>"$out/stderr" || { cat "$out/stderr" "$out"/*.log >&2; exit 1; }
row="$(tail -n 1 "$out/results.csv")"
echo "bench-cluster selftest: $row"
python3 - "$row" <<'PY'
import sys
f = sys.argv[1].split(",")
engine, wire = float(f[10]), float(f[11])
assert engine > 0 and wire > 0, f"no bytes counted: {f}"
assert abs(wire / engine - 1) < 0.05, f"wire {wire} vs engine {engine} bytes differ by more than 5%"
PY
# The same run started by the real launchers across the two emulated
# hosts: mpirun on node 0 with an rsh agent entering node 1's namespace,
# and (with a Python that has torch) torchrun on each node; the hosts
# themselves say which ranks share a node (2 x 2), and the bytes across
# still match the veth counters.
launchers="mpirun"
[ -n "$python" ] && launchers="mpirun torchrun"
for l in $launchers; do
  bash bench-cluster/run.sh --nodes 2 --ranks-per-node 2 --rates 200mbit --modes zeropp --steps 10 \
    --launcher "$l" --zeropp "$zeropp" ${python:+--python "$python"} --out "$out/$l" \
    -- --width 32 --layers 1 --heads 2 --context 32 --batch 2 --val-batches 1 \
    >/dev/null 2>"$out/stderr" || { cat "$out/stderr" "$out/$l"/*.log >&2; exit 1; }
  grep -q "training .* 2 nodes x 2 ranks" "$out/$l"/*node0.log ||
    { echo "bench-cluster selftest: $l did not form 2 nodes x 2 ranks" >&2; cat "$out/$l"/*.log >&2; exit 1; }
  row="$(tail -n 1 "$out/$l/results.csv")"
  echo "bench-cluster selftest: $row"
  python3 - "$row" <<'PY'
import sys
f = sys.argv[1].split(",")
engine, wire = float(f[10]), float(f[11])
assert engine > 0 and wire > 0, f"no bytes counted: {f}"
assert abs(wire / engine - 1) < 0.05, f"{f[0]}: wire {wire} vs engine {engine} bytes differ by more than 5%"
PY
done
probe="$(tail -n 1 "$out/probe.csv")"
echo "bench-cluster selftest: probe $probe"
if python3 - "$probe" <<'PY'
import sys
f = sys.argv[1].split(",")
mean, vs_nominal = float(f[5]), float(f[8])
assert mean > 0, f"the probe moved no data: {f}"
# TCP payload can never exceed the shaped rate (headers take ~4% of it).
assert vs_nominal <= 1.02, f"the link delivered {vs_nominal:.2f}x its shaped rate: tc is not shaping it ({f})"
PY
then :; else cat "$out"/probe-*.json >&2; exit 1; fi
if [ -n "$python" ]; then
  # The ZeRO++ collectives' bytes, not the plan's choice: ZEROPP_PROBE=0
  # keeps mode=zeropp as it is (the one-time probe at join moved 7.3 MB
  # across nodes in the native selftest run here, against 0.57 MB for 10
  # steps of training).
  ZEROPP_PROBE=0 bash bench-cluster/run.sh --nodes 2 --ranks-per-node 2 --rates 200mbit \
    --modes "torch-fsdp2 torch-zero3 torch-zeropp" --steps 10 --zeropp "$zeropp" --python "$python" \
    --out "$out/torch" >/dev/null 2>"$out/stderr" || { cat "$out/stderr" "$out"/torch/*.log >&2; exit 1; }
  tail -n 3 "$out/torch/results.csv" | sed 's/^/bench-cluster selftest: /'
  python3 - "$out/torch/results.csv" <<'PY'
import csv, sys
rows = {r["mode"]: r for r in csv.DictReader(open(sys.argv[1]))}
for m, r in rows.items():
    if m == "torch-fsdp2":
        continue  # gloo's own collectives: only the wire counts them
    engine, wire = float(r["engine_inter_bytes"]), float(r["wire_inter_bytes"])
    assert engine > 0 and wire > 0, f"{m}: no bytes counted: {r}"
    assert abs(wire / engine - 1) < 0.05, f"{m}: wire {wire} vs zeropp {engine} differ by more than 5%"
wire = {m: float(r["wire_inter_bytes"]) for m, r in rows.items()}
ratio = wire["torch-zeropp"] / wire["torch-fsdp2"]
print(f"bench-cluster selftest: across nodes on the wire, zeropp.torch ZeRO++ {ratio:.3f}x and "
      f"ZeRO-3 {wire['torch-zero3'] / wire['torch-fsdp2']:.3f}x plain FSDP2's bytes")
assert ratio <= 0.27, f"ZeRO++ under FSDP2 sent {ratio:.3f}x plain FSDP2's bytes across nodes (limit 0.27)"
PY
fi
# --islands auto from the links measured at join: at 30 Mbit/s the link is
# most of a synchronous step of the 3.76M GPT, so the plan cuts the job
# into one island per node; at 10 Gbit/s it keeps one synchronous job.
for rate in 30mbit:2 10gbit:1; do
  bash bench-cluster/run.sh --nodes 2 --ranks-per-node 2 --rates "${rate%%:*}" --modes zeropp --steps 2 \
    --zeropp "$zeropp" --out "$out/auto-${rate%%:*}" -- --islands auto \
    --width 384 --layers 2 --heads 6 --context 32 --batch 2 --val-batches 1 \
    >/dev/null 2>"$out/stderr" || { cat "$out/stderr" "$out/auto-${rate%%:*}"/*.log >&2; exit 1; }
  chose="$(grep -h 'islands (auto):' "$out/auto-${rate%%:*}"/*node0.log)"
  echo "bench-cluster selftest: ${rate%%:*}: $chose"
  want="${rate##*:}"
  if [ "$want" = 1 ]; then pattern="islands (auto): synchronous"; else pattern="islands (auto): $want islands of 1 node"; fi
  grep -qF "$pattern" <<<"$chose" ||
    { echo "bench-cluster selftest: --islands auto at ${rate%%:*} did not choose $want island(s)" >&2; exit 1; }
done
# Without --islands the run stays one job and the plan says what it would
# propose at 30 Mbit/s.
bash bench-cluster/run.sh --nodes 2 --ranks-per-node 2 --rates 30mbit --modes zeropp --steps 2 \
  --zeropp "$zeropp" --out "$out/propose" -- --width 384 --layers 2 --heads 6 --context 32 \
  --batch 2 --val-batches 1 >/dev/null 2>"$out/stderr" || { cat "$out/stderr" "$out/propose"/*.log >&2; exit 1; }
proposed="$(grep -h '\] islands: 1 (asked); the plan proposes 2' "$out/propose"/*node0.log || true)"
[ -n "$proposed" ] ||
  { echo "bench-cluster selftest: no islands proposed at 30mbit" >&2; cat "$out/propose"/*node0.log >&2; exit 1; }
echo "bench-cluster selftest: $proposed"
if ip netns list | grep -q '^zpb'; then
  echo "bench-cluster selftest: namespaces left behind: $(ip netns list | grep '^zpb')" >&2
  exit 1
fi
echo "bench-cluster selftest: ok"
