"""zeropp.topology() and zeropp.routing_plan(): what `zeropp topo --json`
and `zeropp topo plan --json` report."""

import json
import subprocess

import pytest

import zeropp


def run_json(*cmd):
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def test_topology_is_what_the_command_reports(zeropp_bin):
    assert zeropp.topology() == run_json(zeropp_bin, "topo", "--json")


@pytest.mark.parametrize("nodes,g", [(1, 4), (2, 2), (4, 8)])
def test_routing_plan_is_what_the_command_reports(zeropp_bin, nodes, g):
    plan = zeropp.routing_plan(nodes, g)
    cli = run_json(
        zeropp_bin, "topo", "plan", "--nodes", str(nodes), "--ranks-per-node", str(g), "--json"
    )
    assert plan == cli
    assert plan["nodes"] == nodes and plan["ranks_per_node"] == g
    assert g % plan["hpz_group"] == 0
    assert plan["run_switches"]["switches"]["qgz"] is True, plan["run_switches"]


def test_a_bad_root_is_an_exception():
    with pytest.raises(zeropp.ZeroppError, match="topology of /nonexistent"):
        zeropp.topology("/nonexistent")
