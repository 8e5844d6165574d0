//! The groups of a ZeRO++ job, which every rank builds the same way from
//! its layout: the world, this node, this local rank across nodes, and the
//! ranks sharing this rank's hpZ secondary shard.

use std::sync::Arc;

use crate::comm::{CommError, Group};

use super::plan::Layout;

/// Group ids: the world is 0, nodes from 0x100, hpZ groups from 0x2000,
/// cross-node groups from 0x4000 (the ids of [`crate::comm::job`]).
const NODE_BASE: u16 = 0x100;
const HPZ_BASE: u16 = 0x2000;
const CROSS_BASE: u16 = 0x4000;

/// The standard groups of one rank.
#[derive(Clone)]
pub struct ZeroGroups {
    pub world: Arc<Group>,
    pub node: Arc<Group>,
    pub cross: Arc<Group>,
    /// The ranks sharing this rank's hpZ secondary shard (the node, or a
    /// run of its local ranks).
    pub hpz: Arc<Group>,
}

impl ZeroGroups {
    /// The groups of `l.rank`, with hpZ groups of `hpz_group` consecutive
    /// local ranks (a divisor of the ranks per node).
    pub fn new(l: &Layout, hpz_group: usize) -> Result<ZeroGroups, CommError> {
        let g = l.ranks_per_node;
        if hpz_group == 0 || !g.is_multiple_of(hpz_group) {
            return Err(CommError::Invalid(format!(
                "an hpZ group of {hpz_group} ranks does not divide the {g} ranks of a node"
            )));
        }
        let first = l.rank / hpz_group * hpz_group;
        Ok(ZeroGroups {
            hpz: Arc::new(Group::new(
                HPZ_BASE + (l.rank / hpz_group) as u16,
                (first..first + hpz_group).collect(),
            )?),
            world: Arc::new(Group::new(0, (0..l.world()).collect())?),
            node: Arc::new(Group::new(
                NODE_BASE + l.node() as u16,
                (l.node() * g..(l.node() + 1) * g).collect(),
            )?),
            cross: Arc::new(Group::new(
                CROSS_BASE + l.local() as u16,
                (0..l.nodes).map(|n| n * g + l.local()).collect(),
            )?),
        })
    }
}
