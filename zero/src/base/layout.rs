//! Where ranks sit: a job (or an island, or a mesh dimension) as nodes of
//! equal numbers of ranks, and the groups a collective may run over. A
//! leaf: every module that moves data reads it, and it reads none of them.

use serde::{Deserialize, Serialize};

/// A layout, a mesh over it or a group that zeropp cannot serve, and what
/// to do instead.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct LayoutError(pub String);

/// Where this rank sits: `nodes` × `ranks_per_node`, ranks numbered node by
/// node (rank = node · G + local).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    pub nodes: usize,
    pub ranks_per_node: usize,
    pub rank: usize,
}

impl Layout {
    pub fn world(&self) -> usize {
        self.nodes * self.ranks_per_node
    }
    pub fn node(&self) -> usize {
        self.rank / self.ranks_per_node
    }
    pub fn local(&self) -> usize {
        self.rank % self.ranks_per_node
    }
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.ranks_per_node
    }

    /// Whether `ranks` is the whole world, in rank order.
    pub fn is_world(&self, ranks: &[usize]) -> bool {
        ranks.iter().copied().eq(0..self.world())
    }

    /// This rank's island when the job is cut into `islands` islands of
    /// consecutive whole nodes: the island's number and its layout (this
    /// rank's place among the island's ranks).
    pub fn island(&self, islands: usize) -> Result<(usize, Layout), LayoutError> {
        if islands == 0 || !self.nodes.is_multiple_of(islands) {
            return Err(LayoutError(format!(
                "{islands} islands of a job of {} nodes: the islands are equal sets of whole \
                 nodes, so their number must divide the nodes (1 to {})",
                self.nodes, self.nodes
            )));
        }
        let nodes = self.nodes / islands;
        let size = nodes * self.ranks_per_node;
        Ok((
            self.rank / size,
            Layout {
                nodes,
                ranks_per_node: self.ranks_per_node,
                rank: self.rank % size,
            },
        ))
    }

    /// Whether `islands` islands are each one node (and more than one):
    /// nothing inside them crosses a node.
    pub fn islands_of_one_node(&self, islands: usize) -> bool {
        islands > 1 && self.island(islands).is_ok_and(|(_, l)| l.nodes == 1)
    }

    /// The layout of a mesh dimension over `ranks` (global ranks of a job
    /// laid out as `self`): its nodes are the nodes those ranks are on, and
    /// this rank is its position among them. The ranks must be ascending
    /// and hold as many ranks of every node they span, so that position p
    /// is local rank p mod g of node p / g, as on the whole job.
    pub fn of_ranks(&self, ranks: &[usize]) -> Result<Layout, LayoutError> {
        let ascending = ranks.windows(2).all(|p| p[0] < p[1]);
        let position = ranks.iter().position(|&r| r == self.rank);
        let (Some(&last), true, Some(rank)) = (ranks.last(), ascending, position) else {
            return Err(LayoutError(format!(
                "a mesh dimension over ranks {ranks:?}: zeropp serves a dimension whose ranks \
                 are ascending and include this rank {} (build the mesh with \
                 init_device_mesh, which orders them so)",
                self.rank
            )));
        };
        if last >= self.world() {
            return Err(LayoutError(format!(
                "a mesh dimension over ranks {ranks:?} in a job of {} ranks",
                self.world()
            )));
        }
        let mut per_node: Vec<(usize, usize)> = Vec::new();
        for &r in ranks {
            match per_node.last_mut() {
                Some((node, count)) if *node == self.node_of(r) => *count += 1,
                _ => per_node.push((self.node_of(r), 1)),
            }
        }
        let g = per_node[0].1;
        if let Some(&(node, count)) = per_node.iter().find(|(_, c)| *c != g) {
            return Err(LayoutError(format!(
                "a mesh dimension over ranks {ranks:?} holds {g} ranks of node {} but {count} \
                 of node {node}: zeropp shards over a dimension with as many ranks on every \
                 node it spans (nodes of {} ranks); shape the mesh so that each node holds an \
                 equal part of it",
                per_node[0].0, self.ranks_per_node
            )));
        }
        Ok(Layout {
            nodes: per_node.len(),
            ranks_per_node: g,
            rank,
        })
    }

    /// This rank's node and cross group among `ranks` (a mesh dimension's
    /// global ranks laid out as `self`, from [`Layout::of_ranks`]): its
    /// ranks on this rank's node, and those at this rank's place on every
    /// node.
    pub fn node_and_cross(&self, ranks: &[usize]) -> (Vec<usize>, Vec<usize>) {
        let g = self.ranks_per_node;
        let node = ranks[self.node() * g..(self.node() + 1) * g].to_vec();
        let cross = (0..self.nodes)
            .map(|n| ranks[n * g + self.local()])
            .collect();
        (node, cross)
    }

    /// Checks a group a collective may run over besides the world:
    /// consecutive ranks of one node that include this rank (FSDP2's
    /// `reshard_after_forward=<int>` groups, hpZ's).
    pub fn check_subgroup(&self, ranks: &[usize]) -> Result<(), LayoutError> {
        let consecutive = ranks.windows(2).all(|p| p[1] == p[0] + 1);
        let inside = matches!((ranks.first(), ranks.last()),
            (Some(&f), Some(&l)) if l < self.world() && self.node_of(f) == self.node_of(l));
        if consecutive && inside && ranks.contains(&self.rank) {
            return Ok(());
        }
        Err(LayoutError(format!(
            "zeropp gathers over the world (ranks 0..{}) or over consecutive ranks of one node \
             that include this rank {} (FSDP2's reshard_after_forward=<int> groups); got ranks \
             {ranks:?}: use a 1-D mesh over the whole job",
            self.world(),
            self.rank
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subgroup_is_consecutive_ranks_of_this_rank_s_node() {
        let l = Layout {
            nodes: 2,
            ranks_per_node: 4,
            rank: 5,
        };
        assert!(l.is_world(&[0, 1, 2, 3, 4, 5, 6, 7]) && !l.is_world(&[0, 1, 2, 3]));
        for ok in [&[4, 5][..], &[5], &[4, 5, 6, 7], &[5, 6]] {
            assert!(l.check_subgroup(ok).is_ok(), "{ok:?}");
        }
        for bad in [&[4, 6][..], &[6, 7], &[3, 4, 5], &[], &[5, 8]] {
            let e = l.check_subgroup(bad).unwrap_err();
            let e = e.to_string();
            assert!(e.contains("consecutive ranks of one node"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_mesh_dimension_is_laid_out_on_the_nodes_its_ranks_are_on() {
        let job = |rank| Layout {
            nodes: 2,
            ranks_per_node: 4,
            rank,
        };
        let l = |nodes, g, at| Layout {
            nodes,
            ranks_per_node: g,
            rank: at,
        };
        // HSDP's shard dimension inside a node; its replicate dimension.
        assert_eq!(job(5).of_ranks(&[4, 5, 6, 7]), Ok(l(1, 4, 1)));
        assert_eq!(job(5).of_ranks(&[1, 5]), Ok(l(2, 1, 1)));
        // The dp dimension of a (dp, tp=2) mesh: two ranks on each node.
        let dp = [0, 2, 4, 6];
        assert_eq!(job(6).of_ranks(&dp), Ok(l(2, 2, 3)));
        let groups = (vec![4, 6], vec![2, 6]);
        assert_eq!(l(2, 2, 3).node_and_cross(&dp), groups);
        assert_eq!(job(3).of_ranks(&(0..8).collect::<Vec<_>>()), Ok(job(3)));
        for (bad, says) in [
            (&[2, 3, 4, 5, 6][..], "holds 2 ranks of node 0 but 3"),
            (&[3, 4, 5, 6, 7], "holds 1 ranks of node 0 but 4"),
            (&[5, 4], "ascending"),
            (&[4, 6], "include this rank 5"),
            (&[], "include this rank"),
            (&[5, 9], "in a job of 8 ranks"),
        ] {
            let e = job(5).of_ranks(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
