//! NCCL communicators for a job's groups (world, this rank's node, this
//! rank's cross-node group): each group's first member makes an NCCL id,
//! zeropp's own collectives (TCP or UCX) carry it to the other members, and
//! every member then joins the communicator. A first member that cannot
//! make an id (no NCCL) tells the others, so nobody waits for an id that
//! will never come.

use std::time::Duration;

use bytes::Bytes;
use zeropp_cuda::Gpu;
use zeropp_cuda::nccl::{NcclComm, NcclId};

use super::job::Job;
use super::{CommError, Communicator, Group};

/// An NCCL id is 128 bytes; the message carries one status byte before it.
const ID_LEN: usize = 128;

/// One id per group, made by the group's first member and broadcast over
/// the host communicator. `make` runs only on first members.
pub fn exchange_ids(
    comm: &Communicator,
    my_rank: usize,
    groups: &[&Group],
    make: impl Fn() -> Result<[u8; ID_LEN], String>,
) -> Result<Vec<[u8; ID_LEN]>, CommError> {
    let mut ids = Vec::with_capacity(groups.len());
    for g in groups {
        let root = g.ranks()[0];
        let msg = if my_rank == root {
            match make() {
                Ok(id) => [&[0u8][..], &id[..]].concat(),
                Err(e) => [&[1u8][..], e.as_bytes()].concat(),
            }
        } else {
            Vec::new()
        };
        let got = comm.broadcast(g, 0, Bytes::from(msg))?;
        match got.first() {
            Some(0) if got.len() == 1 + ID_LEN => {
                let mut id = [0u8; ID_LEN];
                id.copy_from_slice(&got[1..]);
                ids.push(id);
            }
            Some(1) => {
                return Err(CommError::Invalid(format!(
                    "rank {root} could not make the NCCL id of group {}: {}",
                    g.id(),
                    String::from_utf8_lossy(&got[1..])
                )));
            }
            _ => {
                return Err(CommError::Invalid(format!(
                    "the NCCL id of group {} from rank {root} arrived damaged ({} bytes)",
                    g.id(),
                    got.len()
                )));
            }
        }
    }
    Ok(ids)
}

/// The job's NCCL communicators on `gpu`.
pub struct NcclGroups {
    pub world: NcclComm,
    /// This rank's node, in local-rank order.
    pub node: NcclComm,
    /// The ranks with this local rank, in node order.
    pub cross: NcclComm,
}

/// Makes the world, node and cross-node communicators of `job` on `gpu`,
/// each join waiting at most `timeout`.
pub fn nccl_groups(job: &Job, gpu: &Gpu, timeout: Duration) -> anyhow::Result<NcclGroups> {
    let f = &job.facts;
    let groups = [
        job.world_group(),
        job.node_group(f.node_rank),
        job.cross_node_group(f.local_rank),
    ];
    let refs: Vec<&Group> = groups.iter().collect();
    let ids = exchange_ids(&job.comm, f.rank, &refs, || {
        NcclId::new()
            .map(|id| id.to_bytes())
            .map_err(|e| e.to_string())
    })?;
    let join = |k: usize| -> anyhow::Result<NcclComm> {
        let g = &groups[k];
        let me = g
            .ranks()
            .iter()
            .position(|&r| r == f.rank)
            .expect("a rank is in its own groups");
        Ok(NcclComm::init(
            gpu,
            &NcclId::from_bytes(&ids[k])?,
            me,
            g.size(),
            timeout,
        )?)
    };
    Ok(NcclGroups {
        world: join(0)?,
        node: join(1)?,
        cross: join(2)?,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::comm::GroupKind;
    use crate::comm::inproc::InProcess;

    /// 2 nodes x 2 ranks over the in-process transport: world, node and
    /// cross groups as a job builds them.
    fn run(make_fails_on: Option<usize>) -> Vec<Result<Vec<[u8; ID_LEN]>, String>> {
        let handles: Vec<_> = InProcess::world(4)
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                std::thread::spawn(move || {
                    let comm = Communicator::new(Arc::new(t), Duration::from_secs(10));
                    let (node, local) = (rank / 2, rank % 2);
                    let world = Group::new(GroupKind::World, vec![0, 1, 2, 3]).unwrap();
                    let node_g =
                        Group::new(GroupKind::Node(node), vec![2 * node, 2 * node + 1]).unwrap();
                    let cross =
                        Group::new(GroupKind::Cross(local), vec![local, 2 + local]).unwrap();
                    let calls = std::sync::atomic::AtomicU8::new(0);
                    exchange_ids(&comm, rank, &[&world, &node_g, &cross], || {
                        if make_fails_on == Some(rank) {
                            return Err("no NCCL here".into());
                        }
                        // Distinct per maker and per call.
                        let n = calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        Ok([rank as u8 * 16 + n; ID_LEN])
                    })
                    .map_err(|e| e.to_string())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_member_gets_its_group_leaders_id() {
        let got: Vec<Vec<[u8; ID_LEN]>> = run(None).into_iter().map(|r| r.unwrap()).collect();
        // World: rank 0's first id on everyone.
        assert!(got.iter().all(|ids| ids[0] == [0u8; ID_LEN]));
        // Nodes: rank 0's second id on node 0, rank 2's first on node 1.
        assert_eq!((got[0][1], got[1][1]), ([1; ID_LEN], [1; ID_LEN]));
        assert_eq!((got[2][1], got[3][1]), ([32; ID_LEN], [32; ID_LEN]));
        // Cross: rank 0's third id for local rank 0, rank 1's first for 1.
        assert_eq!((got[0][2], got[2][2]), ([2; ID_LEN], [2; ID_LEN]));
        assert_eq!((got[1][2], got[3][2]), ([16; ID_LEN], [16; ID_LEN]));
    }

    #[test]
    fn a_leader_without_nccl_is_named_by_everyone() {
        let got = run(Some(0));
        for (rank, r) in got.iter().enumerate() {
            let e = r.as_ref().unwrap_err();
            assert!(
                e.contains("rank 0 could not make the NCCL id") && e.contains("no NCCL here"),
                "rank {rank}: {e}"
            );
        }
    }
}
