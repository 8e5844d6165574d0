//! The groups of a ZeRO++ job, which every rank builds the same way from
//! its layout: the world, this node, this local rank across nodes, and the
//! ranks sharing this rank's hpZ secondary shard. Their ids come from the
//! one allocator ([`GroupKind::id`]).

use std::sync::Arc;

use zeropp_comm::{CommError, Group, GroupKind};

use crate::layout::Layout;

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
    /// Tells the members of each of these groups that this rank gives up
    /// its next call there after `e` (its own failure, or a failed call of
    /// one of them), before it sent anything in it
    /// ([`zeropp_comm::Communicator::give_up_next`]): whichever call they
    /// wait on it in fails at once with the reason, where they would wait
    /// their timeout on a rank that is alive and never sends. The hpZ
    /// group once where it is the node.
    pub fn give_up(&self, comm: &zeropp_comm::Communicator, e: &CommError) {
        let mut told: Vec<&Arc<Group>> = Vec::new();
        for g in [&self.world, &self.node, &self.cross, &self.hpz] {
            if !told.iter().any(|t| Arc::ptr_eq(t, g)) {
                comm.give_up_next(g, e);
                told.push(g);
            }
        }
    }

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

    /// The groups of this rank's island (`job` cut into `islands` islands
    /// of consecutive whole nodes: [`Layout::island`]), hpZ groups of
    /// `hpz_group` consecutive local ranks, and the group of the ranks
    /// at this rank's place in every island (the outer sync's). With one
    /// island these are [`ZeroGroups::new`]'s. Returns the island's layout
    /// beside them.
    pub fn island(
        job: &Layout,
        islands: usize,
        hpz_group: usize,
    ) -> Result<(Layout, ZeroGroups, Arc<Group>), CommError> {
        let (island, l) = job
            .island(islands)
            .map_err(|e| CommError::Group(e.to_string()))?;
        let size = l.world();
        let across = Arc::new(Group::new(
            GroupKind::Across {
                place: Some(l.rank),
                members: 0,
            },
            (0..islands).map(|i| i * size + l.rank).collect(),
        )?);
        if islands == 1 {
            return Ok((l, ZeroGroups::new(job, hpz_group)?, across));
        }
        let g = l.ranks_per_node;
        if hpz_group == 0 || !g.is_multiple_of(hpz_group) {
            return Err(CommError::Group(format!(
                "an hpZ group of {hpz_group} ranks does not divide the {g} ranks of a node"
            )));
        }
        let first = island * size;
        let node = Arc::new(Group::new(
            GroupKind::Node(job.node()),
            (job.node() * g..(job.node() + 1) * g).collect(),
        )?);
        let groups = ZeroGroups {
            hpz: ZeroGroups::run_or_node(&node, job.rank / hpz_group * hpz_group, hpz_group)?,
            world: Arc::new(Group::new(
                GroupKind::Island {
                    island,
                    local: None,
                },
                (first..first + size).collect(),
            )?),
            cross: Arc::new(Group::new(
                GroupKind::Island {
                    island,
                    local: Some(l.local()),
                },
                (0..l.nodes).map(|n| first + n * g + l.local()).collect(),
            )?),
            node,
        };
        Ok((l, groups, across))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn job(nodes: usize, g: usize, rank: usize) -> Layout {
        Layout {
            nodes,
            ranks_per_node: g,
            rank,
        }
    }

    #[test]
    fn an_island_is_consecutive_whole_nodes_and_across_holds_its_place_in_each() {
        // 4 nodes x 2 in 2 islands: rank 5 is place 1 of island 1 (ranks 4..8).
        let (l, g, across) = ZeroGroups::island(&job(4, 2, 5), 2, 1).unwrap();
        assert_eq!(l, job(2, 2, 1));
        assert_eq!(g.world.ranks(), &[4, 5, 6, 7]);
        assert_eq!(g.node.ranks(), &[4, 5]);
        assert_eq!(g.cross.ranks(), &[5, 7]);
        assert_eq!(g.hpz.ranks(), &[5]);
        assert_eq!(across.ranks(), &[1, 5]);
        let ids = [&g.world, &g.node, &g.cross, &g.hpz, &across].map(|g| g.id());
        for (i, a) in ids.iter().enumerate() {
            assert!(!ids[i + 1..].contains(a), "ids {ids:?}");
        }
        // One island is the job's own groups.
        let (l, g, across) = ZeroGroups::island(&job(2, 2, 3), 1, 2).unwrap();
        assert_eq!(l, job(2, 2, 3));
        assert_eq!(g.world.kind(), GroupKind::World);
        assert_eq!(g.cross.kind(), GroupKind::Cross(1));
        assert_eq!(across.ranks(), &[3]);
    }

    #[test]
    fn islands_that_do_not_divide_the_nodes_are_refused() {
        let e = ZeroGroups::island(&job(3, 2, 0), 2, 1).err().unwrap();
        assert!(e.to_string().contains("must divide the nodes"), "{e}");
        assert!(ZeroGroups::island(&job(3, 2, 0), 0, 1).is_err());
    }
}
