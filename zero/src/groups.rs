//! The groups of a ZeRO++ job, which every rank builds the same way from
//! its layout: the world, this node, this local rank across nodes, and the
//! ranks sharing this rank's hpZ secondary shard. Their ids come from the
//! one allocator ([`GroupKind::id`]).

use std::sync::Arc;

use zeropp_comm::{CommError, Group, GroupKind};

use super::plan::Layout;

/// The standard groups of one rank.
#[derive(Clone)]
pub struct ZeroGroups {
    pub world: Arc<Group>,
    pub node: Arc<Group>,
    pub cross: Arc<Group>,
    /// The ranks sharing this rank's hpZ secondary shard: the node itself
    /// (the same group), or a run of its local ranks.
    pub hpz: Arc<Group>,
}

impl ZeroGroups {
    /// The groups of `l.rank`, with hpZ groups of `hpz_group` consecutive
    /// local ranks (a divisor of the ranks per node).
    pub fn new(l: &Layout, hpz_group: usize) -> Result<ZeroGroups, CommError> {
        let g = l.ranks_per_node;
        if hpz_group == 0 || !g.is_multiple_of(hpz_group) {
            return Err(CommError::Group(format!(
                "an hpZ group of {hpz_group} ranks does not divide the {g} ranks of a node"
            )));
        }
        let node = Arc::new(Group::new(
            GroupKind::Node(l.node()),
            (l.node() * g..(l.node() + 1) * g).collect(),
        )?);
        Ok(ZeroGroups {
            hpz: ZeroGroups::run_or_node(&node, l.rank / hpz_group * hpz_group, hpz_group)?,
            world: Arc::new(Group::new(GroupKind::World, (0..l.world()).collect())?),
            cross: Arc::new(Group::new(
                GroupKind::Cross(l.local()),
                (0..l.nodes).map(|n| n * g + l.local()).collect(),
            )?),
            node,
        })
    }

    /// The groups of a mesh dimension over `ranks` (global ranks, laid out
    /// as `l`: [`Layout::of_ranks`]), hpZ over its node: the dimension is
    /// the world, its ranks on one node the node, its ranks of one
    /// position in their node the cross group. `group` gives the group of
    /// a set of global ranks (the job's own where it has one, so one set
    /// of ranks is one group with one sequence of calls).
    pub fn of_ranks(
        l: &Layout,
        ranks: &[usize],
        mut group: impl FnMut(Vec<usize>) -> Result<Arc<Group>, CommError>,
    ) -> Result<ZeroGroups, CommError> {
        let g = l.ranks_per_node;
        if ranks.len() != l.world() || l.rank >= l.world() {
            return Err(CommError::Group(format!(
                "ranks {ranks:?} are not laid out as {} nodes x {g}",
                l.nodes
            )));
        }
        let (node, cross) = l.node_and_cross(ranks);
        let node = group(node)?;
        Ok(ZeroGroups {
            world: group(ranks.to_vec())?,
            cross: group(cross)?,
            hpz: node.clone(),
            node,
        })
    }

    /// The group of `size` consecutive ranks from `first` (inside `node`):
    /// `node` itself when it is those ranks, so one set of ranks is one
    /// group with one sequence of calls.
    pub fn run_or_node(
        node: &Arc<Group>,
        first: usize,
        size: usize,
    ) -> Result<Arc<Group>, CommError> {
        if node.ranks().iter().copied().eq(first..first + size) {
            return Ok(node.clone());
        }
        Ok(Arc::new(Group::new(
            GroupKind::Run { first, size },
            (first..first + size).collect(),
        )?))
    }
}
