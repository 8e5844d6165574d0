//! Groups of ranks and the one allocator of their ids. A group's id follows
//! from what the group is ([`GroupKind`]) and nothing else, so every member
//! computes the same id, and two different groups of a job never share the
//! tags their messages travel under.

use std::sync::atomic::{AtomicU32, Ordering};

use super::{CommError, Tag};

/// What a group is. Every kind of group a job makes is named here, and
/// [`GroupKind::id`] gives each a different id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GroupKind {
    /// Every rank of the job.
    World,
    /// The ranks of node `n`, in local-rank order.
    Node(usize),
    /// The ranks with local rank `l`, one per node, in node order.
    Cross(usize),
    /// `size` consecutive ranks from `first`, smaller than their node: hpZ
    /// groups and FSDP2's `reshard_after_forward=<int>` groups. A run as
    /// large as its node is that node's group ([`GroupKind::Node`]).
    Run { first: usize, size: usize },
    /// The `n`-th group of a caller's own numbering (tools and tests): every
    /// member numbers its groups alike.
    Numbered(usize),
    /// The ranks of nodes `node` and `node + 1`, or with `local: Some(l)`
    /// their two ranks of local rank `l`: the probe of the link between
    /// two consecutive nodes (where islands could be cut).
    Seam { node: usize, local: Option<usize> },
    /// A group whose number its members agreed on through the job's store
    /// (a mesh dimension's groups in `zeropp.torch`): one number per set of
    /// ranks in the whole job.
    Agreed(usize),
    /// The ranks of island `island` (consecutive whole nodes), or with
    /// `local: Some(l)` those of its ranks with local rank `l`, one per
    /// node of the island, in node order.
    Island { island: usize, local: Option<usize> },
    /// The ranks at place `place` of the islands in the outer sync (one
    /// per island, in island order): the islands' outer sync of the shard
    /// they hold; `place: None`, every rank of those islands (the job's
    /// bookkeeping once an island is lost). `members` is 0 while every
    /// island takes part and none ever left, else
    /// [`GroupKind::members_digest`] of those that do and of how many came
    /// back: each change of membership is a group of its own.
    Across { place: Option<usize>, members: u8 },
    /// A restarted island's requests to rejoin and the state it is sent
    /// (point-to-point messages between the islands, outside any
    /// collective): [`rejoin_tag`].
    Rejoin,
}

/// Bits of a group id (the top of a message tag).
const ID_BITS: u32 = 24;
/// The low bits of an id hold the kind's payload, the top three the kind.
const PAYLOAD_BITS: u32 = ID_BITS - 3;
/// A run's payload: its first rank above, its size − 1 below.
const RUN_SIZE_BITS: u32 = 9;
const RUN_FIRST_BITS: u32 = PAYLOAD_BITS - RUN_SIZE_BITS;

/// An island's payload: the island above, its local rank + 1 below (0:
/// the whole island).
const ISLAND_LOCAL_BITS: u32 = 12;
const ISLAND_BITS: u32 = PAYLOAD_BITS - ISLAND_LOCAL_BITS;
/// A seam's payload (below its top bit): the node above, its local rank + 1
/// below (0: both nodes).
const SEAM_LOCAL_BITS: u32 = 11;
const SEAM_NODE_BITS: u32 = PAYLOAD_BITS - 1 - SEAM_LOCAL_BITS;
/// An outer sync group's payload: the members' digest above, the place + 1
/// below (0: every rank of the members).
const ACROSS_PLACE_BITS: u32 = PAYLOAD_BITS - 8;

/// The largest run a group id holds (`2^9` ranks) and the first rank it can
/// start at (below `2^12`).
pub const MAX_RUN: usize = 1 << RUN_SIZE_BITS;
pub const MAX_RUN_FIRST: usize = 1 << RUN_FIRST_BITS;

impl GroupKind {
    /// The group's id: the kind in the top three of 24 bits, its payload
    /// below (a node, a local rank, a number, or a run's first rank and
    /// size). Different kinds or payloads give different ids; a payload too
    /// large to hold is an error that says which limit it passed.
    pub fn id(self) -> Result<u32, CommError> {
        let limit = 1usize << PAYLOAD_BITS;
        let fits = |what: &str, v: usize| {
            if v < limit {
                Ok(v as u32)
            } else {
                Err(CommError::Group(format!(
                    "{what} {v}: zeropp's group ids hold values below {limit}"
                )))
            }
        };
        let (kind, payload) = match self {
            GroupKind::World => (0u32, 0u32),
            GroupKind::Node(n) => (1, fits("node", n)?),
            GroupKind::Cross(l) => (2, fits("local rank", l)?),
            GroupKind::Run { first, size } => {
                if size == 0 || size > MAX_RUN || first >= MAX_RUN_FIRST {
                    return Err(CommError::Group(format!(
                        "a group of {size} consecutive ranks from rank {first}: zeropp's \
                         sub-groups hold 1 to {MAX_RUN} ranks starting below rank \
                         {MAX_RUN_FIRST} (a whole node is its node group)"
                    )));
                }
                (3, ((first as u32) << RUN_SIZE_BITS) | (size as u32 - 1))
            }
            // Numbers below half the payload, seams above.
            GroupKind::Numbered(n) => {
                if n >= 1 << (PAYLOAD_BITS - 1) {
                    return Err(CommError::Group(format!(
                        "group number {n}: zeropp's group ids hold numbers below {}",
                        1usize << (PAYLOAD_BITS - 1)
                    )));
                }
                (4, n as u32)
            }
            GroupKind::Seam { node, local } => {
                let local = local.map_or(0, |l| l + 1);
                if node >= 1 << SEAM_NODE_BITS || local >= 1 << SEAM_LOCAL_BITS {
                    return Err(CommError::Group(format!(
                        "the link after node {node} with local rank {local}: zeropp's group ids \
                         hold seams below node {} of nodes below {} ranks",
                        1usize << SEAM_NODE_BITS,
                        (1usize << SEAM_LOCAL_BITS) - 1
                    )));
                }
                let payload = (1 << (PAYLOAD_BITS - 1)) | ((node as u32) << SEAM_LOCAL_BITS);
                (4, payload | local as u32)
            }
            GroupKind::Agreed(n) => (5, fits("agreed group number", n)?),
            GroupKind::Island { island, local } => {
                let local = local.map_or(0, |l| l + 1);
                if island >= 1 << ISLAND_BITS || local >= 1 << ISLAND_LOCAL_BITS {
                    return Err(CommError::Group(format!(
                        "island {island} with local rank {local}: zeropp's group ids hold \
                         islands below {} of nodes below {} ranks",
                        1usize << ISLAND_BITS,
                        (1usize << ISLAND_LOCAL_BITS) - 1
                    )));
                }
                (6, ((island as u32) << ISLAND_LOCAL_BITS) | local as u32)
            }
            GroupKind::Across { place, members } => {
                let place = place.map_or(0, |p| p + 1);
                if place >= (1 << ACROSS_PLACE_BITS) - 1 {
                    return Err(CommError::Group(format!(
                        "place {} in an island: zeropp's group ids hold islands of fewer \
                         than {} ranks",
                        place - 1,
                        (1usize << ACROSS_PLACE_BITS) - 1
                    )));
                }
                (7, ((members as u32) << ACROSS_PLACE_BITS) | place as u32)
            }
            // The one payload no outer sync group has.
            GroupKind::Rejoin => (7, (1 << PAYLOAD_BITS) - 1),
        };
        Ok((kind << PAYLOAD_BITS) | payload)
    }

    /// The `members` of an outer sync group of the islands `alive` says
    /// take part after `rejoins` islands came back: 0 when all do and none
    /// ever left, else a digest in 1..=255 of which and when. The rejoins
    /// set the same islands after a loss and a rejoin apart from the same
    /// islands before: a regrouped group counts its calls from 0 again, and
    /// what a call given up before may have left at a rank (its messages,
    /// a member's notice that it gave the call up) must not be taken for a
    /// later call's.
    pub fn members_digest(alive: &[bool], rejoins: usize) -> u8 {
        if rejoins == 0 && alive.iter().all(|&a| a) {
            return 0;
        }
        let mut h: u32 = 0x811c_9dc5;
        for (i, &a) in alive.iter().enumerate() {
            if a {
                h = (h ^ i as u32).wrapping_mul(0x0100_0193);
            }
        }
        for b in (rejoins as u32).to_le_bytes() {
            h = (h ^ b as u32).wrapping_mul(0x0100_0193);
        }
        (h % 255) as u8 + 1
    }
}

/// An ordered set of global ranks that run collectives together.
#[derive(Debug)]
pub struct Group {
    kind: GroupKind,
    id: u32,
    ranks: Vec<usize>,
    seq: AtomicU32,
}

impl Group {
    /// The group `kind` over `ranks` (global ranks, in group order, no
    /// repeats; a run's must be its consecutive ranks).
    pub fn new(kind: GroupKind, ranks: Vec<usize>) -> Result<Self, CommError> {
        let id = kind.id()?;
        let mut sorted = ranks.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != ranks.len() || ranks.is_empty() {
            return Err(CommError::Group(format!(
                "group {kind:?} must list distinct ranks, got {ranks:?}"
            )));
        }
        if let GroupKind::Run { first, size } = kind
            && !ranks.iter().copied().eq(first..first + size)
        {
            return Err(CommError::Group(format!(
                "group {kind:?} must be ranks {first}..{}, got {ranks:?}",
                first + size
            )));
        }
        Ok(Group {
            kind,
            id,
            ranks,
            seq: AtomicU32::new(0),
        })
    }

    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    pub fn kind(&self) -> GroupKind {
        self.kind
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    /// The sequence number of this member's next collective on the group.
    pub(crate) fn next_call(&self) -> u32 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }
}

/// The tag of a rejoin message of kind `what` ([`GroupKind::Rejoin`]).
pub fn rejoin_tag(what: u16) -> Tag {
    let id = GroupKind::Rejoin.id().expect("the rejoin id fits");
    ((id as u64) << 40) | what as u64
}

/// Whether `tag` is a rejoin or liveness message's (outside every
/// collective: a restarted rank sends them before its island rejoins).
pub(crate) fn is_rejoin(tag: Tag) -> bool {
    GroupKind::Rejoin
        .id()
        .is_ok_and(|id| tag >> 40 == id as u64)
}

/// A liveness message's tag ([`super::liveness`]): outside every
/// collective, beside the rejoin tags (bit 39 set), `kind` and `nonce` below.
pub(crate) fn liveness_tag(kind: u8, nonce: u32) -> Tag {
    let id = GroupKind::Rejoin.id().expect("the rejoin id fits");
    ((id as u64) << 40) | (1 << 39) | ((kind as u64) << 32) | nonce as u64
}

/// A notice that a rank gave up a call ([`super::liveness::gave_up`]):
/// outside every collective, beside the liveness tags.
pub(crate) fn gave_up_tag() -> Tag {
    liveness_tag(4, 0)
}

/// The call a collective message's tag belongs to: its group's id and the
/// call's sequence number (modulo 2^24), without the step.
pub(crate) fn call_of(tag: Tag) -> (u32, u32) {
    ((tag >> 40) as u32, ((tag >> 16) & 0xff_ffff) as u32)
}

/// Whether call `call` of a group comes after call `first` of it (modulo
/// 2^24: a member is never 2^23 calls ahead of another).
pub(crate) fn is_after(call: u32, first: u32) -> bool {
    let ahead = call.wrapping_sub(first) & 0xff_ffff;
    ahead != 0 && ahead < 1 << 23
}

/// The tag of step `step` of call `call` on `group`: the group's id in the
/// top 24 bits, the call's sequence number (modulo 2^24: a member is never
/// that many calls ahead of another) in the next 24, the step in the low 16.
pub(crate) fn tag(group: &Group, call: u32, step: usize) -> Tag {
    ((group.id as u64) << 40) | (((call & 0xff_ffff) as u64) << 16) | (step as u64 & 0xffff)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    /// Every group a job of `nodes` × `g` ranks can make: the world, each
    /// node, each cross-node group, every run of consecutive ranks inside a
    /// node smaller than it, and a few numbered ones.
    fn every_group(nodes: usize, g: usize) -> Vec<GroupKind> {
        let mut all = vec![GroupKind::World];
        all.extend((0..nodes).map(GroupKind::Node));
        all.extend((0..g).map(GroupKind::Cross));
        for n in 0..nodes {
            for size in 1..g {
                for start in 0..=g - size {
                    all.push(GroupKind::Run {
                        first: n * g + start,
                        size,
                    });
                }
            }
        }
        all.extend((0..8).map(GroupKind::Numbered));
        all.extend((0..8).map(GroupKind::Agreed));
        for node in 0..nodes.saturating_sub(1) {
            all.push(GroupKind::Seam { node, local: None });
            all.extend((0..g).map(|l| GroupKind::Seam {
                node,
                local: Some(l),
            }));
        }
        for island in 0..nodes {
            all.push(GroupKind::Island {
                island,
                local: None,
            });
            all.extend((0..g).map(|l| GroupKind::Island {
                island,
                local: Some(l),
            }));
        }
        for members in [0, 1, 255] {
            all.extend((0..g).map(|p| GroupKind::Across {
                place: Some(p),
                members,
            }));
            all.push(GroupKind::Across {
                place: None,
                members,
            });
        }
        all.push(GroupKind::Rejoin);
        all
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn group_ids_never_collide(nodes in 1usize..=64, g in 1usize..=64) {
            prop_assume!(nodes * g <= 1024);
            let mut seen: HashMap<u32, GroupKind> = HashMap::new();
            for kind in every_group(nodes, g) {
                let id = kind.id().unwrap();
                prop_assert!(id < 1 << ID_BITS);
                if let Some(other) = seen.insert(id, kind) {
                    prop_assert!(false, "{kind:?} and {other:?} share id {id:#x}");
                }
            }
        }
    }

    #[test]
    fn the_largest_shapes_get_distinct_ids() {
        // 1024 ranks on one node (runs up to 512 of them) and 1024 nodes of
        // one rank: checked exhaustively for the aligned runs hpZ makes.
        for (nodes, g) in [(1, 1024), (1024, 1), (2, 512), (512, 2), (32, 32)] {
            let mut seen = HashMap::new();
            let mut kinds = vec![GroupKind::World];
            kinds.extend((0..nodes).map(GroupKind::Node));
            kinds.extend((0..g).map(GroupKind::Cross));
            let mut size = 1;
            while size < g {
                kinds.extend((0..nodes * g / size).map(|k| GroupKind::Run {
                    first: k * size,
                    size,
                }));
                size *= 2;
            }
            for kind in kinds {
                assert_eq!(seen.insert(kind.id().unwrap(), kind), None, "{kind:?}");
            }
        }
    }

    #[test]
    fn the_old_collision_is_gone_and_limits_are_named() {
        // The bindings' old ids gave a 33-rank group a 1-rank group's id.
        let a = GroupKind::Run { first: 0, size: 33 }.id().unwrap();
        let b = GroupKind::Run { first: 0, size: 1 }.id().unwrap();
        assert_ne!(a, b);
        let e = GroupKind::Run {
            first: 0,
            size: MAX_RUN + 1,
        }
        .id()
        .unwrap_err()
        .to_string();
        assert!(e.contains("1 to 512 ranks"), "{e}");
        // A run must hold its own ranks.
        let e = Group::new(GroupKind::Run { first: 4, size: 2 }, vec![4, 6]).unwrap_err();
        assert!(e.to_string().contains("ranks 4..6"), "{e}");
    }

    #[test]
    fn tags_keep_group_call_and_step_apart() {
        let a = Group::new(GroupKind::Node(1), vec![2, 3]).unwrap();
        let b = Group::new(GroupKind::Cross(1), vec![1, 3]).unwrap();
        assert_ne!(tag(&a, 0, 0), tag(&b, 0, 0));
        assert_ne!(tag(&a, 1, 0), tag(&a, 0, 1));
        assert_eq!(tag(&a, 1 << 24, 3), tag(&a, 0, 3)); // calls wrap at 2^24
    }
}
