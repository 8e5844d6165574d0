#!/usr/bin/env bash
# Captures what real launchers set for each rank of a 2-host x 2-rank job
# (two network namespaces joined by a bridge stand in for the hosts, as in
# bench-cluster/), plus each rank's host identity as zeropp reads it
# (hostname; boot id / network namespace). Writes one file per launcher,
# ranks in order, into this directory: the fixtures of
# comm/src/fixtures.rs. Run as root: bash tests/data/launch-env/capture.sh PYTHON
#   mpirun-by-slot.env   mpirun -np 4 (Open MPI's default placement)
#   mpirun-by-node.env   mpirun -np 4 --map-by node (round robin)
#   torchrun-2x2.env     torchrun --nnodes 2 --nproc-per-node 2 on each host
#   srun-1x4.env         srun -n 4 -O on a single-node Slurm (scripts/slurm.sh)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${1:-python3}"
NETNS_TAG="zpc$$"
NETNS_PREFIX=10.78.0
# shellcheck source=bench-cluster/netns.sh
. "$here/../../../bench-cluster/netns.sh"
ns() { netns_name "$1"; }
ip_of() { netns_ip "$1"; }
cleanup() {
  netns_down 2
  rm -rf "$tmp"
}
tmp="$(mktemp -d)"
trap cleanup EXIT
netns_up 2

# What one rank records: the launcher's variables (not the whole
# environment) and its host identity.
cat > "$tmp/record.sh" <<'REC'
#!/bin/sh
out="$1"; rank="${OMPI_COMM_WORLD_RANK:-${RANK:-${SLURM_PROCID}}}"
{
  echo "# rank $rank"
  env | grep -E '^(OMPI_COMM_WORLD_|OMPI_UNIVERSE_SIZE|SLURM_(PROCID|NTASKS|LOCALID|NODEID|NNODES|TASKS_PER_NODE|STEP_TASKS_PER_NODE|JOB_NODELIST|STEP_NODELIST|NODELIST|LAUNCH_NODE_IPADDR|STEP_NUM_NODES|STEP_NUM_TASKS|JOB_NUM_NODES|SUBMIT_HOST)=|RANK=|WORLD_SIZE=|LOCAL_RANK=|LOCAL_WORLD_SIZE=|GROUP_RANK=|GROUP_WORLD_SIZE=|ROLE_RANK=|ROLE_WORLD_SIZE=|MASTER_ADDR=|MASTER_PORT=|TORCHELASTIC_(RUN_ID|RESTART_COUNT|USE_AGENT_STORE)=)' | sort
  echo "ZEROPP_FIXTURE_HOST=$(hostname)"
  echo "ZEROPP_FIXTURE_HOST_ID=$(cat /proc/sys/kernel/random/boot_id)/$(readlink /proc/self/ns/net)"
} > "$out.$rank"
REC
chmod +x "$tmp/record.sh"
collect() { # name: the rank files, in rank order, into one fixture
  local f="$here/$1.env"
  echo "# $2 (captured by tests/data/launch-env/capture.sh)" > "$f"
  for r in 0 1 2 3; do cat "$tmp/$1.$r" >> "$f"; done
  rm -f "$tmp/$1".*
  echo "wrote $f"
}

cat > "$tmp/agent" <<AG
#!/bin/sh
host="\$1"; shift
case "\$host" in $(ip_of 0)) n=$(ns 0) ;; $(ip_of 1)) n=$(ns 1) ;; *) exit 1 ;; esac
exec ip netns exec "\$n" sh -c "\$*"
AG
chmod +x "$tmp/agent"
printf '%s slots=2\n%s slots=2\n' "$(ip_of 0)" "$(ip_of 1)" > "$tmp/hosts"
for placement in slot node; do
  ip netns exec "$(ns 0)" env MASTER_ADDR="$(ip_of 0)" mpirun --allow-run-as-root --oversubscribe \
    -np 4 --hostfile "$tmp/hosts" --map-by "$placement" --mca plm_rsh_agent "$tmp/agent" \
    --mca oob_tcp_if_include eth0 -x MASTER_ADDR "$tmp/record.sh" "$tmp/mpirun-by-$placement"
  collect "mpirun-by-$placement" "mpirun -np 4 --map-by $placement over 2 hosts x 2 slots (Open MPI $(mpirun --version | head -1 | awk '{print $NF}'))"
done

pids=()
for k in 0 1; do
  ip netns exec "$(ns $k)" "$python" -m torch.distributed.run --nnodes 2 --node-rank "$k" \
    --nproc-per-node 2 --master-addr "$(ip_of 0)" --master-port 29511 --no-python \
    "$tmp/record.sh" "$tmp/torchrun-2x2" >/dev/null 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
collect torchrun-2x2 "torchrun --nnodes 2 --node-rank K --nproc-per-node 2 on 2 hosts (torch $("$python" -c 'import torch; print(torch.__version__)'))"

if command -v srun >/dev/null; then
  srun -n 4 -O "$tmp/record.sh" "$tmp/srun-1x4"
  collect srun-1x4 "srun -n 4 -O on one host ($(srun --version))"
fi
