//! The in-process transport: ranks are threads of one process and a send is a
//! move into the receiver's mailbox. For unit tests and one-process runs.

use std::sync::Arc;
use std::time::Duration;

use super::mailbox::Mailbox;
use bytes::Bytes;

use super::{CommError, SendHandle, Tag, Transport};

/// One rank's end of an in-process world.
pub struct InProcess {
    rank: usize,
    mailboxes: Arc<Vec<Mailbox>>,
}

impl InProcess {
    /// A world of `n` ranks; hand element `r` to the thread that is rank `r`.
    pub fn world(n: usize) -> Vec<InProcess> {
        let mailboxes: Arc<Vec<Mailbox>> = Arc::new((0..n).map(|_| Mailbox::default()).collect());
        (0..n)
            .map(|rank| InProcess {
                rank,
                mailboxes: mailboxes.clone(),
            })
            .collect()
    }

    fn check_peer(&self, peer: usize) -> Result<(), CommError> {
        if peer >= self.mailboxes.len() {
            return Err(CommError::NoSuchRank {
                peer,
                world: self.mailboxes.len(),
            });
        }
        Ok(())
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        // Peers waiting on this rank learn at once that it is gone.
        for (peer, mailbox) in self.mailboxes.iter().enumerate() {
            if peer != self.rank {
                mailbox.peer_left(self.rank, "its thread ended".into());
            }
        }
    }
}

impl Transport for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.mailboxes.len()
    }

    fn send(&self, peer: usize, tag: Tag, data: Bytes) -> Result<SendHandle, CommError> {
        self.check_peer(peer)?;
        self.mailboxes[peer].deliver(self.rank, tag, data);
        Ok(SendHandle::done())
    }

    fn recv(&self, peer: usize, tag: Tag, timeout: Duration) -> Result<Bytes, CommError> {
        self.check_peer(peer)?;
        self.mailboxes[self.rank].take(peer, tag, timeout)
    }

    fn probe(&self, peer: usize, tag: Tag) -> bool {
        peer < self.mailboxes.len() && self.mailboxes[self.rank].has(peer, tag)
    }

    fn first_death(&self) -> Option<(usize, String)> {
        self.mailboxes[self.rank].first_death()
    }

    fn contain_deaths(&self, fatal: std::ops::Range<usize>) {
        self.mailboxes[self.rank].contain(fatal)
    }

    fn declare_dead(&self, peer: usize, reason: String) {
        self.mailboxes[self.rank].peer_died(peer, reason)
    }

    fn waiting_from(&self, tag: Tag) -> Vec<usize> {
        self.mailboxes[self.rank].sources_with(tag)
    }

    fn name(&self) -> &'static str {
        "inproc"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Transport;

    #[test]
    fn a_missing_rank_or_a_group_without_this_rank_is_a_typed_error() {
        let t = InProcess::world(2).into_iter().next().expect("two ranks");
        match t.send(5, 1, Bytes::from_static(b"x")) {
            Err(CommError::NoSuchRank { peer: 5, world: 2 }) => {}
            Err(e) => panic!("expected NoSuchRank, got {e:?}"),
            Ok(_) => panic!("a send to rank 5 of 2 went through"),
        }
        let e = CommError::NoSuchRank { peer: 5, world: 2 };
        assert!(!e.is_peer_failure());
        assert!(
            e.to_string()
                .contains("rank 5 does not exist in a world of 2")
        );
        let comm =
            crate::Communicator::new(std::sync::Arc::new(t), std::time::Duration::from_secs(1));
        let other =
            crate::Group::new(crate::GroupKind::Node(1), vec![1]).expect("a group of rank 1");
        match comm.all_gather_v(&other, Bytes::from_static(b"x")) {
            Err(CommError::NotInGroup { rank: 0, .. }) => {}
            other => panic!("expected NotInGroup, got {other:?}"),
        }
    }
}
