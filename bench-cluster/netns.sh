# Emulated hosts, sourced by bench-cluster/run.sh and
# tests/data/launch-env/capture.sh (as root): host k is the network namespace
# "$NETNS_TAG-n$k" with eth0 at $NETNS_PREFIX.(10+k)/24, and every host's
# veth ends on one bridge in "$NETNS_TAG-sw". Set NETNS_TAG and NETNS_PREFIX
# (e.g. 10.77.0) before calling.
netns_name() { echo "$NETNS_TAG-n$1"; }
netns_ip() { echo "$NETNS_PREFIX.$((10 + $1))"; }

# netns_down NODES: kills what runs in the hosts and removes them and the bridge.
netns_down() {
  local k
  for k in $(seq 0 $(($1 - 1))); do
    ip netns pids "$(netns_name "$k")" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$(netns_name "$k")" 2>/dev/null || true
  done
  ip netns del "$NETNS_TAG-sw" 2>/dev/null || true
}

# netns_up NODES: NODES hosts on one bridge, loopback and eth0 up.
netns_up() {
  local k ns sw="$NETNS_TAG-sw"
  ip netns add "$sw"
  ip -n "$sw" link add br0 type bridge
  ip -n "$sw" link set br0 up
  for k in $(seq 0 $(($1 - 1))); do
    ns="$(netns_name "$k")"
    ip netns add "$ns"
    ip link add "${NETNS_TAG}a$k" type veth peer name "${NETNS_TAG}b$k"
    ip link set "${NETNS_TAG}a$k" netns "$ns"
    ip link set "${NETNS_TAG}b$k" netns "$sw"
    ip -n "$ns" link set "${NETNS_TAG}a$k" name eth0
    ip -n "$ns" addr add "$(netns_ip "$k")/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    ip -n "$sw" link set "${NETNS_TAG}b$k" master br0
    ip -n "$sw" link set "${NETNS_TAG}b$k" up
  done
}

# netns_rate_bps RATE: bits per second of a tc rate like 100mbit.
netns_rate_bps() {
  python3 - "$1" <<'PY'
import re, sys
m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", sys.argv[1].lower())
if not m:
    sys.exit(f"bench-cluster: rate {sys.argv[1]!r} is not like 100mbit")
print(int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]))
PY
}

# netns_tbf K RATE: host K's egress shaped to RATE by a token bucket with
# 10 ms of burst (at least 16 KiB) and 200 ms of queue.
netns_tbf() {
  local bps burst
  bps=$(netns_rate_bps "$2") || return 1
  burst=$(( bps / 800 > 16384 ? bps / 800 : 16384 ))
  tc -n "$(netns_name "$1")" qdisc add dev eth0 root tbf rate "$2" burst "$burst" latency 200ms
}

# netns_counter NODES STAT: the sum of eth0's statistic STAT (tx_bytes,
# tx_packets, ...) over the hosts.
netns_counter() {
  local total=0 k
  for k in $(seq 0 $(($1 - 1))); do
    total=$((total + $(ip netns exec "$(netns_name "$k")" cat "/sys/class/net/eth0/statistics/$2")))
  done
  echo "$total"
}
