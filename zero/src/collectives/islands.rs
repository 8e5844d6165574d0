//! Which islands take part in the outer sync, and an outer exchange that
//! goes on without an island lost during it: the native trainer's
//! islands (`zeropp train --islands`) and zeropp.torch's `OuterSync` run
//! their exchanges through [`Across`]. An island is lost when one of its
//! ranks dies or does not answer (the transport contains the death to its
//! island: `Transport::contain_deaths`); the islands left run the exchange
//! again among themselves, and alone an island keeps its own delta.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use zeropp_comm::group::rejoin_tag;
use zeropp_comm::{CommError, Communicator, Group, GroupKind, Transport};

use crate::Hop;
use crate::allreduce::QuantizedAllReduce;
use crate::error::ZeroError;
use crate::groups::ZeroGroups;
use crate::host::HostMover;
use crate::outer;
use crate::residual::Residual;
use crate::traffic::CountingTransport;

/// Which islands take part in the outer sync, as this rank knows it: an
/// island one of whose ranks died or did not answer an exchange is lost,
/// and every later exchange averages over the islands left (alone: the
/// island's own delta). Shared by the compute thread and the islands'.
#[derive(Debug)]
pub struct Membership {
    /// Islands of the job, and ranks in each.
    pub alive: Vec<bool>,
    pub size: usize,
    /// This rank's island and place in it.
    pub island: usize,
    pub place: usize,
    /// Islands lost: each with the step of the exchange (or job-wide call)
    /// that found it gone, and why.
    pub lost: Vec<LostIsland>,
    /// Islands that came back: each with the step after which it
    /// trained with the others again.
    pub rejoined: Vec<(usize, u64)>,
    /// The ranks at this place of the islands taking part (rebuilt, its
    /// calls numbered from 0 again, at each change).
    pub across: Arc<Group>,
    /// Every rank of the islands taking part, once membership changed
    /// (`None`: the job's world).
    pub job: Option<Arc<Group>>,
    /// Whether the ranks of `across` have checked they are at one exchange
    /// since it was made: a regrouped `across` starts unchecked, and its
    /// first exchange begins with the check on every member (each came to
    /// it its own way: an exchange that failed, the island's agreement, a
    /// rejoin).
    pub checked: bool,
    /// Why an exchange failed in a way no regroup mends (this rank's own
    /// island broke): the exchanges queued after it fail at once, sending
    /// nothing, rather than number their calls differently from the
    /// islands they talk to (whose ranks would read a later exchange's
    /// message as this one's).
    pub broken: Option<String>,
    /// The last call across the islands this rank completed (an exchange,
    /// or the agreement on who rejoins), and its result where three or
    /// more islands ran it: a rank that did not complete it (the island
    /// lost during it reached this rank's call and not that rank's) takes
    /// it from here, so both go on from the same call ([`same_exchange`]).
    /// At most one unit's shard in f32, replaced at each call.
    pub last: Option<(ExchangeName, Option<Vec<f32>>)>,
}

/// An island that left the outer sync.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LostIsland {
    pub island: usize,
    /// The optimizer step after which it was found gone.
    pub step: u64,
    pub why: String,
}

/// What a rank knows of the islands' past — which were lost and which
/// came back, with their steps — sent with a rejoin state so that the
/// rejoined rank reports the whole run, its own loss included.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct History {
    pub lost: Vec<LostIsland>,
    pub rejoined: Vec<(usize, u64)>,
}

impl History {
    /// As sent with a rejoin state.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a history serializes")
    }

    /// [`History::to_bytes`] read back; what is wrong with it said.
    pub fn from_bytes(b: &[u8]) -> Result<History, ZeroError> {
        serde_json::from_slice(b)
            .map_err(|e| ZeroError::Invalid(format!("an unreadable history of the islands: {e}")))
    }
}

impl Membership {
    pub fn new(count: usize, size: usize, island: usize, place: usize, across: Arc<Group>) -> Self {
        Membership {
            alive: vec![true; count],
            size,
            island,
            place,
            lost: Vec::new(),
            rejoined: Vec::new(),
            across,
            job: None,
            checked: true,
            broken: None,
            last: None,
        }
    }

    /// New groups for the islands taking part now (both numbered from 0
    /// on every member alike).
    pub fn regroup(&mut self) -> Result<(), ZeroError> {
        let digest = self.digest();
        self.checked = false;
        let ranks: Vec<usize> = self.members().map(|m| m * self.size + self.place).collect();
        self.across = Arc::new(Group::new(
            GroupKind::Across {
                place: Some(self.place),
                members: digest,
            },
            ranks,
        )?);
        let everyone: Vec<usize> = self
            .members()
            .flat_map(|m| m * self.size..(m + 1) * self.size)
            .collect();
        self.job = Some(Arc::new(Group::new(
            GroupKind::Across {
                place: None,
                members: digest,
            },
            everyone,
        )?));
        Ok(())
    }

    /// Island `i` takes part again from the exchanges after `step`.
    pub fn rejoin(&mut self, i: usize, step: u64) -> Result<(), ZeroError> {
        if i < self.alive.len() && !self.alive[i] {
            self.alive[i] = true;
            self.rejoined.push((i, step));
            self.regroup()?;
        }
        Ok(())
    }

    /// The islands lost and rejoined so far, as this rank knows it.
    pub fn history(&self) -> History {
        History {
            lost: self.lost.clone(),
            rejoined: self.rejoined.clone(),
        }
    }

    /// This rank's island rejoined after `step`, the islands taking part
    /// being `alive` and their past `history` (as the state it was sent
    /// said): their ranks are readmitted to the collectives (another
    /// island restarted beside this one, taken back at the same sync, too)
    /// and the groups across the islands are made as the others made
    /// theirs.
    pub fn joined(
        &mut self,
        transport: &dyn Transport,
        alive: Vec<bool>,
        step: u64,
        history: History,
    ) -> Result<(), ZeroError> {
        if alive.len() != self.alive.len() || !alive[self.island] {
            return Err(ZeroError::Invalid(format!(
                "the state sent names {} islands without this one (island {} of {})",
                alive.len(),
                self.island,
                self.alive.len()
            )));
        }
        for (i, _) in alive.iter().enumerate().filter(|(_, a)| **a) {
            for r in i * self.size..(i + 1) * self.size {
                transport.readmit(r);
            }
        }
        self.alive = alive;
        (self.lost, self.rejoined) = (history.lost, history.rejoined);
        if !self.rejoined.contains(&(self.island, step)) {
            self.rejoined.push((self.island, step));
        }
        self.regroup()
    }

    /// The island that answers island `j`'s request to rejoin: the first
    /// taking part.
    pub fn host_for(&self, j: usize) -> Option<usize> {
        self.members().find(|&i| i != j)
    }

    /// Whether an island is out of the outer sync now.
    pub fn missing_any(&self) -> bool {
        self.alive.iter().any(|&a| !a)
    }

    fn digest(&self) -> u8 {
        GroupKind::members_digest(&self.alive, self.rejoined.len())
    }

    /// Island `i` is lost after `step` (the rank that showed it: `why`),
    /// if it was not already. True when it is out of the outer sync now
    /// (a call over a group with it may run again without it); false for
    /// this rank's own island, which nothing here takes out.
    pub fn lose(&mut self, i: usize, step: u64, why: String) -> Result<bool, ZeroError> {
        if i == self.island || i >= self.alive.len() {
            return Ok(false);
        }
        if !self.alive[i] {
            return Ok(true);
        }
        self.alive[i] = false;
        self.lost.push(LostIsland {
            island: i,
            step,
            why,
        });
        self.regroup()?;
        Ok(true)
    }

    /// The island of global rank `rank`.
    pub fn island_of(&self, rank: usize) -> usize {
        rank / self.size
    }

    fn members(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.alive.len()).filter(|&i| self.alive[i])
    }

    /// Every rank of the islands taking part, once membership changed
    /// (`None`: the job's world serves).
    pub fn survivors(&self) -> Option<Arc<Group>> {
        self.job.clone()
    }
}

/// Which outer exchange a rank is at: of unit `unit` of outer sync `sync`
/// after optimizer step `step` (where a loss found in it is recorded), the
/// `seq`-th that outer sync started (telling apart two exchanges of one
/// unit after one step: a sync at the end of a run right after the unit's
/// own). `sync` tells apart the outer syncs over the same islands (two
/// models, each with its own; the native trainer has one, 0), whose
/// units, steps and counts are their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExchangeName {
    pub sync: u64,
    pub step: u64,
    pub unit: usize,
    pub seq: u64,
}

impl ExchangeName {
    const BYTES: usize = 32;

    /// The `sync` of the islands' agreement on who rejoins ([`agree_ready`]),
    /// no outer sync's.
    const AGREEMENT: u64 = u64::MAX;

    /// Whether this names an agreement on who rejoins, no exchange.
    pub fn is_agreement(&self) -> bool {
        self.sync == Self::AGREEMENT
    }

    /// The islands' agreement on who rejoins after optimizer step `step`.
    pub fn agreement(step: u64) -> ExchangeName {
        ExchangeName {
            sync: Self::AGREEMENT,
            step,
            unit: 0,
            seq: 0,
        }
    }

    fn bytes(&self) -> [u8; Self::BYTES] {
        let words = [self.sync, self.step, self.unit as u64, self.seq];
        let mut b = [0u8; Self::BYTES];
        for (to, w) in b.chunks_exact_mut(8).zip(words) {
            to.copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    fn of(b: &[u8]) -> Option<ExchangeName> {
        let b: &[u8; Self::BYTES] = b.try_into().ok()?;
        let word = |i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]));
        Some(ExchangeName {
            sync: word(0),
            step: word(1),
            unit: word(2) as usize,
            seq: word(3),
        })
    }
}

impl std::fmt::Display for ExchangeName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_agreement() {
            return write!(f, "the agreement on who rejoins after step {}", self.step);
        }
        write!(f, "exchange ")?;
        if self.seq > 0 {
            write!(f, "#{} ", self.seq)?;
        }
        write!(f, "of unit {} after step {}", self.unit, self.step)?;
        if self.sync > 0 {
            write!(f, " of outer sync {}", self.sync)?;
        }
        Ok(())
    }
}

/// Where the check before an exchange ([`same_exchange`]) left this rank.
#[derive(Debug, PartialEq)]
pub enum Checked {
    /// Every rank of `across` is at the exchange: run it.
    Same,
    /// The others completed this exchange before its lost island failed
    /// this rank's call: its result, as they have it.
    Completed(Vec<f32>),
    /// Check again: this rank handed the call before to ranks that had
    /// not completed it, or waited for ranks that skip the call they are
    /// at (they come to this one next).
    Again,
    /// This rank is at an agreement on who rejoins that the others never
    /// make (they did not know of the loss when their islands chose
    /// whether to agree): nobody rejoins, as they take it.
    Skipped,
}

/// What a rank says of itself at the check: the exchange it is at, and
/// the last it completed (when it kept that one's result).
const CHECK_BYTES: usize = 1 + 2 * ExchangeName::BYTES;

/// Before an exchange runs again over the islands left after a loss: the
/// ranks of `across` check they are all at exchange `name`. One may have
/// completed an exchange the lost island still answered while another did
/// not: then each of them is at the one it completed, or the next; the
/// ranks that completed it (`last`, with its result) hand the result to the
/// others, which take it as theirs ([`Checked::Completed`]), and both go on
/// from the next ([`Checked::Again`]). Likewise an island that found the
/// loss before its membership round agrees on who rejoins, where one that
/// found it after goes straight to its next exchange: from the same last
/// call, the first skip the agreement ([`Checked::Skipped`]) and the others
/// check again. Ranks at calls that neither mends fail with a named error.
pub fn same_exchange(
    c: &Communicator,
    across: &Group,
    name: ExchangeName,
    last: Option<(ExchangeName, Option<&[f32]>)>,
) -> Result<Checked, ZeroError> {
    let mut said = [0u8; CHECK_BYTES];
    said[1..1 + ExchangeName::BYTES].copy_from_slice(&name.bytes());
    if let Some((done, values)) = last {
        said[0] = 1 + u8::from(values.is_some());
        said[1 + ExchangeName::BYTES..].copy_from_slice(&done.bytes());
    }
    let all = c.all_gather_v(across, Bytes::copy_from_slice(&said))?;
    let heard: Vec<Said> = all.iter().map(|b| Said::read(b)).collect();
    if heard.iter().all(|h| h.at == Some(name)) {
        return Ok(Checked::Same);
    }
    let me = across
        .ranks()
        .iter()
        .position(|&r| r == c.rank())
        .ok_or_else(|| ZeroError::Invalid("this rank is not in the islands' group".into()))?;
    if let Some(agreeing) = skipped_agreement(&heard) {
        return Ok(match agreeing[me] {
            true => Checked::Skipped,
            false => Checked::Again,
        });
    }
    let Some((behind, giver)) = handover(&heard) else {
        let (j, theirs) = heard
            .iter()
            .enumerate()
            .find(|(_, h)| h.at != Some(name))
            .map(|(j, h)| (j, h.at))
            .expect("a rank at another exchange");
        let theirs = theirs.map_or("a malformed answer".into(), |t| t.to_string());
        return Err(ZeroError::Invalid(format!(
            "after an island was lost the islands left are at different exchanges: this rank \
             at {name}, rank {} at {theirs}, and neither completed the other's; resume the job \
             from its last checkpoint",
            across.ranks()[j]
        )));
    };
    // Every rank decided the same from the same answers: the giver sends
    // the result to each rank behind, nothing to the others.
    let to_each = (0..across.size())
        .map(|j| match (me == giver && behind[j], last) {
            (true, Some((_, Some(values)))) => zeropp_comm::collectives::f32_bytes(values),
            _ => Bytes::new(),
        })
        .collect();
    let got = c.all_to_all_v(across, to_each)?;
    if !behind[me] {
        return Ok(Checked::Again);
    }
    Ok(Checked::Completed(zeropp_comm::collectives::bytes_f32(
        &got[giver],
    )?))
}

/// What a rank said at the check: the call it is at, the last it
/// completed, and whether it kept that one's result; `None` where it
/// says nothing readable.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Said {
    at: Option<ExchangeName>,
    done: Option<ExchangeName>,
    kept: bool,
}

impl Said {
    fn read(b: &[u8]) -> Said {
        let n = ExchangeName::BYTES;
        if b.len() != CHECK_BYTES || b[0] > 2 {
            return Said::default();
        }
        Said {
            at: ExchangeName::of(&b[1..1 + n]),
            done: (b[0] > 0).then(|| ExchangeName::of(&b[1 + n..])).flatten(),
            kept: b[0] == 2,
        }
    }
}

/// The two calls the ranks are at (`None`: any other number, or an
/// unreadable answer).
fn two_calls(heard: &[Said]) -> Option<[ExchangeName; 2]> {
    let mut at: Vec<ExchangeName> = Vec::new();
    for h in heard {
        let a = h.at?;
        if !at.contains(&a) {
            at.push(a);
        }
    }
    at.try_into().ok()
}

/// When all completed the same last call and are at two, one an agreement
/// on who rejoins and the other not: the ranks at the agreement (which
/// the others skipped).
fn skipped_agreement(heard: &[Said]) -> Option<Vec<bool>> {
    let [x, y] = two_calls(heard)?;
    let same_last = heard.iter().all(|h| h.done == heard[0].done);
    let agreement = match (x.is_agreement(), y.is_agreement()) {
        (true, false) => x,
        (false, true) => y,
        _ => return None,
    };
    same_last.then(|| heard.iter().map(|h| h.at == Some(agreement)).collect())
}

/// When the ranks are at two calls and every rank at one of them completed
/// the other and kept its result: which ranks are behind, and the first
/// rank ahead, which hands them the result.
fn handover(heard: &[Said]) -> Option<(Vec<bool>, usize)> {
    let [x, y] = two_calls(heard)?;
    let completed = |ahead: ExchangeName, behind: ExchangeName| {
        heard
            .iter()
            .filter(|h| h.at == Some(ahead))
            .all(|h| h.done == Some(behind) && h.kept)
    };
    let behind = [(x, y), (y, x)]
        .into_iter()
        .find(|&(b, a)| completed(a, b))
        .map(|(b, _)| b)?;
    let is_behind: Vec<bool> = heard.iter().map(|h| h.at == Some(behind)).collect();
    let giver = is_behind.iter().position(|b| !b)?;
    Some((is_behind, giver))
}

/// What one unit's outer exchange runs with, on the islands' thread.
pub struct Across<'a> {
    pub members: &'a Mutex<Membership>,
    pub counter: &'a CountingTransport,
    pub quantized: Option<QuantizedAllReduce>,
}

/// An exchange's result: the averaged delta, both residuals after it and
/// the seconds it took.
pub type Exchanged = (Vec<f32>, Residual, Residual, f64);

impl Across<'_> {
    /// Exchange `name` of this island's delta `mine` with the islands
    /// alive, run again without an island that is lost during it (its
    /// residuals start over then).
    pub fn exchange(
        &self,
        c: &Communicator,
        mine: Vec<f32>,
        (mut sent, mut owned): (Residual, Residual),
        name: ExchangeName,
    ) -> std::result::Result<Exchanged, ZeroError> {
        let t = Instant::now();
        let ran = named_call(self.members, c, name, mine.len(), |across, first| {
            if !first {
                (sent, owned) = (Residual::none(), Residual::none());
            }
            let mover = HostMover {
                comm: c,
                counter: self.counter,
                groups: ZeroGroups {
                    world: across.clone(),
                    node: across.clone(),
                    cross: across.clone(),
                    hpz: across.clone(),
                },
            };
            let mut delta = mine.clone();
            let residuals = (&mut sent, &mut owned);
            outer::exchange(&mover, Hop::World, self.quantized, residuals, &mut delta)?;
            Ok(delta)
        })?;
        let took = t.elapsed().as_secs_f64();
        Ok(match ran {
            Ran::Alone => (mine, Residual::none(), Residual::none(), 0.0),
            Ran::Together(delta) => (delta, sent, owned, took),
            // This rank's residuals went with the call that failed.
            Ran::Taken(delta) => (delta, Residual::none(), Residual::none(), took),
            Ran::Skipped => {
                return Err(ZeroError::Invalid(format!(
                    "{name} was taken for an agreement on who rejoins"
                )));
            }
        })
    }
}

/// How a [`named_call`] ended.
enum Ran {
    /// This island alone takes part: nothing ran.
    Alone,
    /// The call ran with the islands taking part: its result.
    Together(Vec<f32>),
    /// The others completed it before its lost island failed this rank's
    /// call: their result.
    Taken(Vec<f32>),
    /// The others skip it (an agreement: [`Checked::Skipped`]).
    Skipped,
}

/// Call `name` over the islands taking part (`call(across, first try)`, a
/// result of `len` values), run again without an island lost during it.
/// Run again, or first over islands regrouped since the last call, it
/// begins with the check that every rank is at it ([`same_exchange`]),
/// which hands the result of a call the lost island completed with some
/// ranks and not others to those left behind. With three or more islands
/// the result is kept for that.
fn named_call(
    members: &Mutex<Membership>,
    c: &Communicator,
    name: ExchangeName,
    len: usize,
    mut call: impl FnMut(&Arc<Group>, bool) -> Result<Vec<f32>, ZeroError>,
) -> Result<Ran, ZeroError> {
    let mut again = false;
    loop {
        let (across, unchecked) = {
            let m = lock(members);
            if let Some(why) = &m.broken {
                return Err(ZeroError::Invalid(format!(
                    "not started: an earlier outer exchange failed ({why})"
                )));
            }
            (m.across.clone(), !m.checked)
        };
        if across.size() == 1 {
            return Ok(Ran::Alone);
        }
        let checked = if again || unchecked {
            check(members, c, &across, name)
        } else {
            Ok(Checked::Same)
        };
        let first = !again;
        again = true;
        let tried = checked.and_then(|checked| match checked {
            Checked::Same => call(&across, first).map(Ran::Together).map(Some),
            Checked::Completed(result) if result.len() == len => {
                tracing::warn!(
                    "islands: {name} was completed by the islands left before the lost one \
                     failed it here; this rank takes their result"
                );
                Ok(Some(Ran::Taken(result)))
            }
            Checked::Completed(result) => Err(ZeroError::Invalid(format!(
                "{name}: the islands left completed it with {} values where this rank has \
                 {len}; resume the job from its last checkpoint",
                result.len()
            ))),
            Checked::Again => Ok(None),
            Checked::Skipped => Ok(Some(Ran::Skipped)),
        });
        match tried {
            Ok(Some(Ran::Skipped)) => return Ok(Ran::Skipped),
            Ok(Some(ran)) => {
                // The name always (a later check compares it); the result
                // where a rank can be left behind without it: three or
                // more islands ran it (of two, one is left after a loss;
                // one that took it has no rank behind).
                let kept = match &ran {
                    Ran::Together(r) if across.size() >= 3 => Some(r.clone()),
                    _ => None,
                };
                lock(members).last = Some((name, kept));
                return Ok(ran);
            }
            Ok(None) => {}
            Err(e) => lose_the_failed_island(members, e, name.step)?,
        }
    }
}

/// [`same_exchange`] with the last call this rank completed; once every
/// rank is at `name`, `across` is checked.
fn check(
    members: &Mutex<Membership>,
    c: &Communicator,
    across: &Arc<Group>,
    name: ExchangeName,
) -> Result<Checked, ZeroError> {
    // Taken out while the check talks (only the thread of the islands'
    // calls uses it).
    let last = lock(members).last.take();
    let done = last.as_ref().map(|(n, values)| (*n, values.as_deref()));
    let checked = same_exchange(c, across, name, done);
    let mut m = lock(members);
    m.last = last;
    if matches!(checked, Ok(Checked::Same)) && Arc::ptr_eq(&m.across, across) {
        m.checked = true;
    }
    checked
}

/// After error `e` of a call across the islands: the island of the rank
/// that failed leaves the outer sync (Ok: run the call again without it),
/// or, when no island can be taken out for it, the islands' sync is
/// broken (`e`).
fn lose_the_failed_island(
    members: &Mutex<Membership>,
    e: ZeroError,
    step: u64,
) -> std::result::Result<(), ZeroError> {
    let mut m = lock(members);
    let before = m.lost.len();
    let lost = match e.failed_peer() {
        Some(peer) => {
            let island = m.island_of(peer);
            m.lose(island, step, e.what_happened())?
        }
        None => false,
    };
    if !lost {
        m.broken = Some(e.to_string());
        return Err(e);
    }
    if m.lost.len() > before {
        tracing::warn!(
            "islands: island {} left the outer sync after step {step} ({}); the others go on",
            m.lost.last().map_or(0, |l| l.island),
            e.what_happened()
        );
    }
    Ok(())
}

/// The islands taking part agree which lost islands come back: `ready`
/// (one value per island: 1 where every rank of this island found all of
/// that island's places asking) is summed over this rank's place in each
/// island taking part — an island lost during the call is taken out and
/// the call runs again without it, as an exchange does. Every rank of those
/// islands calls it at the same point (after `step`'s exchanges). Returns
/// the islands found ready, the same on each of them.
pub fn agree_ready(
    members: &Mutex<Membership>,
    c: &Communicator,
    ready: &[f32],
    step: u64,
) -> Result<Vec<usize>, ZeroError> {
    let count = lock(members).alive.len();
    if ready.len() != count {
        return Err(ZeroError::Invalid(format!(
            "ready: {} values for {count} islands",
            ready.len()
        )));
    }
    let name = ExchangeName::agreement(step);
    let sums = match named_call(members, c, name, count, |across, _| {
        Ok(c.all_reduce_f32(across, ready)?)
    })? {
        Ran::Alone => ready.to_vec(),
        Ran::Together(sums) | Ran::Taken(sums) => sums,
        // The islands that knew of no loss then take nobody back.
        Ran::Skipped => {
            tracing::warn!(
                "islands: some islands left found the loss only after their membership round \
                 and go on to their exchanges: this rank skips {name}, and nobody rejoins then"
            );
            vec![0.0; count]
        }
    };
    Ok((0..count).filter(|&j| sums[j] > 0.0).collect())
}

/// The membership, even if a thread panicked holding it (it is only ever
/// changed whole).
pub fn lock(m: &Mutex<Membership>) -> std::sync::MutexGuard<'_, Membership> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Rejoin messages: a restarted rank's request, and the state it is sent.
const REJOIN_REQUEST: u16 = 1;
const REJOIN_STATE: u16 = 2;

/// Island `j` takes part again after `step` (every rank of the islands
/// taking part calls it at the same point): its rank at this place's
/// request is answered, its ranks readmitted to the collectives, and the
/// groups across the islands made anew. Its state follows
/// ([`send_rejoin_state`], from the host island). An island back already
/// is left as it is.
pub fn take_back(
    members: &Mutex<Membership>,
    transport: &dyn Transport,
    j: usize,
    step: u64,
    timeout: Duration,
) -> Result<(), ZeroError> {
    let mut m = lock(members);
    if j >= m.alive.len() {
        return Err(ZeroError::Invalid(format!(
            "no island {j} of {}",
            m.alive.len()
        )));
    }
    if m.alive[j] {
        return Ok(());
    }
    let peer = j * m.size + m.place;
    let request = rejoin_tag(REJOIN_REQUEST);
    if transport.probe(peer, request) {
        let _ = transport.recv(peer, request, timeout);
    }
    for r in j * m.size..(j + 1) * m.size {
        transport.readmit(r);
    }
    m.rejoin(j, step)
}

/// Sends `state` to island `j`'s rank at this rank's place (on the island
/// that hosts its rejoin) and returns while it crosses: the island trains
/// on meanwhile (the state is the size of a few shards, over the slow
/// link). A failure is logged: the rejoining rank then finds no state and
/// fails, and its island is lost again at the next exchange.
pub fn send_rejoin_state(
    members: &Mutex<Membership>,
    transport: &dyn Transport,
    j: usize,
    state: Bytes,
    timeout: Duration,
) {
    let peer = {
        let m = lock(members);
        j * m.size + m.place
    };
    let warn = move |e: CommError| {
        tracing::warn!("sending the state to rejoining rank {peer} failed: {e}");
    };
    match transport.send(peer, rejoin_tag(REJOIN_STATE), state) {
        Ok(sent) => {
            let watched = std::thread::Builder::new()
                .name("zeropp-rejoin-state".into())
                .spawn(move || sent.wait(peer, timeout).unwrap_or_else(warn));
            if let Err(e) = watched {
                tracing::warn!("no thread to watch the state sent to rank {peer}: {e}");
            }
        }
        Err(e) => warn(e),
    }
}

/// Whether island `j` is out and its rank at this rank's place asked to
/// be taken back, for every island.
pub fn asked_to_rejoin(members: &Mutex<Membership>, transport: &dyn Transport) -> Vec<bool> {
    let m = lock(members);
    (0..m.alive.len())
        .map(|j| !m.alive[j] && transport.probe(j * m.size + m.place, rejoin_tag(REJOIN_REQUEST)))
        .collect()
}

/// A restarted rank of a lost island: asks the islands' ranks at its
/// place to take it back and waits (up to `wait`: the others answer at
/// their next outer sync) for the state one sends. Returns the rank that
/// sent it and the state.
pub fn ask_to_rejoin(
    members: &Mutex<Membership>,
    transport: &dyn Transport,
    wait: Duration,
) -> Result<(usize, Bytes), ZeroError> {
    let others: Vec<usize> = {
        let m = lock(members);
        (0..m.alive.len())
            .filter(|&i| i != m.island)
            .map(|i| i * m.size + m.place)
            .collect()
    };
    for &peer in &others {
        if let Err(e) = transport.send(peer, rejoin_tag(REJOIN_REQUEST), Bytes::new()) {
            tracing::debug!("no rejoin request to rank {peer}: {e}");
        }
    }
    let deadline = Instant::now() + wait;
    // Each other island's rank at this place, until it sends the state or
    // is gone (the job ended, or that island is lost too).
    let mut waiting = others;
    loop {
        for peer in waiting.clone() {
            match transport.recv(peer, rejoin_tag(REJOIN_STATE), Duration::from_millis(10)) {
                Ok(state) => return Ok((peer, state)),
                Err(CommError::Timeout { .. }) => {}
                Err(e) => {
                    tracing::debug!("rank {peer} will not take this island back: {e}");
                    waiting.retain(|&p| p != peer);
                }
            }
        }
        if waiting.is_empty() {
            return Err(ZeroError::Comm(CommError::Join(
                "every other island finished or was lost before this one could rejoin (or a \
                 rank of this island died): nothing to rejoin"
                    .into(),
            )));
        }
        if Instant::now() >= deadline {
            return Err(ZeroError::Comm(CommError::Join(format!(
                "no island took this one back within {wait:?}: the others did not reach an outer \
                 sync (raise ZEROPP_TIMEOUT_S if H steps take longer) or finished"
            ))));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::testing::on_world;

    /// Each rank of two nodes checks it is at `names[rank]`.
    fn check(names: [ExchangeName; 2]) -> Vec<Result<Checked, ZeroError>> {
        on_world(2, 1, Duration::from_secs(10), move |r| {
            same_exchange(&r.comm, &r.groups.cross, names[r.layout.rank], None)
        })
    }

    /// A rank at `at` that completed `done` and kept its result.
    fn said(at: Option<ExchangeName>, done: Option<ExchangeName>) -> Said {
        Said {
            at,
            done,
            kept: done.is_some(),
        }
    }

    /// Rank `rank`'s membership of four islands of one rank, island 3
    /// lost (the groups made anew without it).
    fn three_left_of_four(rank: usize) -> Mutex<Membership> {
        let kind = GroupKind::Across {
            place: Some(0),
            members: 0,
        };
        let across = Arc::new(Group::new(kind, (0..4).collect()).unwrap());
        let m = Mutex::new(Membership::new(4, 1, rank, 0, across));
        lock(&m).lose(3, 20, "killed".into()).unwrap();
        m
    }

    fn at(step: u64, unit: usize) -> ExchangeName {
        ExchangeName {
            sync: 0,
            step,
            unit,
            seq: 0,
        }
    }

    #[test]
    fn a_rank_the_lost_island_left_behind_takes_the_exchange_the_others_completed() {
        // Four islands of one rank; island 3 died during exchange x: its
        // last message reached islands 0 and 1, which completed x and
        // went on to y, and not island 2, whose x failed. All three took
        // island 3 out. Island 2 takes x's result from island 0 (not a
        // redone x over three islands: that would differ from the
        // others'), then all three run y together.
        let (x, y) = (at(20, 0), at(20, 1));
        let completed = vec![0.25f32; 1000];
        let got = on_world(3, 1, Duration::from_secs(20), move |r| {
            let rank = r.layout.rank;
            let m = three_left_of_four(rank);
            let with = Across {
                members: &m,
                counter: &r.counter,
                quantized: None,
            };
            let none = || (Residual::none(), Residual::none());
            let mut results = Vec::new();
            if rank < 2 {
                lock(&m).last = Some((x, Some(vec![0.25; 1000])));
            } else {
                let mine = vec![9.0; 1000];
                results.push(with.exchange(&r.comm, mine, none(), x).map(|e| e.0));
            }
            let mine = vec![rank as f32; 1000];
            results.push(with.exchange(&r.comm, mine, none(), y).map(|e| e.0));
            let last = lock(&m).last.clone();
            (results, last)
        });
        for (rank, (results, last)) in got.into_iter().enumerate() {
            let results: Vec<_> = results
                .into_iter()
                .map(|r| r.map_err(|e| e.to_string()))
                .collect();
            let mut want = vec![Ok(vec![1.0; 1000])];
            if rank == 2 {
                want.insert(0, Ok(completed.clone()));
            }
            assert_eq!(results, want, "rank {rank}");
            // y is what a rank left behind now would take.
            assert_eq!(last, Some((y, Some(vec![1.0; 1000]))), "rank {rank}");
        }
    }

    #[test]
    fn a_rank_left_behind_while_the_others_agree_who_rejoins_takes_the_exchange_first() {
        // As above, but the islands ahead, knowing of a lost island, next
        // agree who rejoins (island 3 asked): the rank left behind takes
        // exchange x from them, then agrees with them.
        let x = at(20, 0);
        let got = on_world(3, 1, Duration::from_secs(20), move |r| {
            let rank = r.layout.rank;
            let m = three_left_of_four(rank);
            let mut took = None;
            if rank < 2 {
                lock(&m).last = Some((x, Some(vec![0.5; 100])));
            } else {
                let with = Across {
                    members: &m,
                    counter: &r.counter,
                    quantized: None,
                };
                let none = (Residual::none(), Residual::none());
                let got = with.exchange(&r.comm, vec![9.0; 100], none, x);
                took = Some(got.map(|e| e.0).map_err(|e| e.to_string()));
            }
            let ready = [0.0, 0.0, 0.0, (rank == 0) as u8 as f32];
            let back = agree_ready(&m, &r.comm, &ready, 22).map_err(|e| e.to_string());
            (took, back)
        });
        assert_eq!(got[2].0, Some(Ok(vec![0.5; 100])));
        for (rank, (_, back)) in got.into_iter().enumerate() {
            assert_eq!(back, Ok(vec![3]), "rank {rank}");
        }
    }

    #[test]
    fn islands_that_found_a_loss_later_skip_the_agreement_the_others_are_at() {
        // Four islands of one rank, island 3 lost. Islands 0 and 1 knew it
        // at their membership round and agree who rejoins (island 3
        // asked); island 2, from the same last exchange, found it only in
        // its next exchange y and never agrees: the others take nobody
        // back, as it does, and all three run y.
        let (x, y) = (at(20, 0), at(22, 0));
        let got = on_world(3, 1, Duration::from_secs(20), move |r| {
            let rank = r.layout.rank;
            let m = three_left_of_four(rank);
            // Islands 0 and 1 took x from island 2 (a handover): they
            // kept its name alone.
            lock(&m).last = Some((x, (rank == 2).then(|| vec![0.5; 10])));
            let mut back = None;
            if rank < 2 {
                let ready = [0.0, 0.0, 0.0, 1.0];
                back = Some(agree_ready(&m, &r.comm, &ready, 22).map_err(|e| e.to_string()));
            }
            let with = Across {
                members: &m,
                counter: &r.counter,
                quantized: None,
            };
            let none = (Residual::none(), Residual::none());
            let mine = vec![rank as f32; 10];
            let synced = with.exchange(&r.comm, mine, none, y);
            (back, synced.map(|e| e.0).map_err(|e| e.to_string()))
        });
        for (rank, (back, synced)) in got.into_iter().enumerate() {
            let want = (rank < 2).then(|| Ok(Vec::new()));
            assert_eq!(back, want, "rank {rank}");
            assert_eq!(synced, Ok(vec![1.0; 10]), "rank {rank}");
        }
    }

    #[test]
    fn ranks_at_exchanges_no_handover_mends_are_told_so() {
        let (x, y, z) = (at(20, 0), at(20, 1), at(20, 2));
        // Ranks 0 and 1 completed x and are at y; rank 2 is at x.
        let heard = [
            said(Some(y), Some(x)),
            said(Some(y), Some(x)),
            said(Some(x), Some(z)),
        ];
        assert_eq!(handover(&heard), Some((vec![false, false, true], 0)));
        // The same, ranks ahead listed after.
        let heard = [said(Some(x), None), said(Some(y), Some(x))];
        assert_eq!(handover(&heard), Some((vec![true, false], 1)));
        // One rank ahead did not keep x's result (or completed another).
        for other in [None, Some(z)] {
            let heard = [
                said(Some(y), Some(x)),
                said(Some(y), other),
                said(Some(x), None),
            ];
            assert_eq!(handover(&heard), None, "{other:?}");
        }
        // Completed x over two islands: its name kept, not its result.
        let named = Said {
            kept: false,
            ..said(Some(y), Some(x))
        };
        assert_eq!(handover(&[named, said(Some(x), None)]), None);
        // Three exchanges, or an answer that says none.
        let heard = [
            said(Some(y), Some(x)),
            said(Some(z), Some(y)),
            said(Some(x), None),
        ];
        assert_eq!(handover(&heard), None);
        assert_eq!(handover(&[said(Some(y), Some(x)), said(None, None)]), None);
        // At an agreement and an exchange from one last call: the
        // agreement is skipped; from two, or at two exchanges, it is not.
        let agree = ExchangeName::agreement(20);
        let heard = [said(Some(agree), Some(x)), said(Some(y), Some(x))];
        assert_eq!(skipped_agreement(&heard), Some(vec![true, false]));
        let heard = [said(Some(agree), Some(z)), said(Some(y), Some(x))];
        assert_eq!(skipped_agreement(&heard), None);
        // A rank that took x from the others kept its name alone: the
        // same last call.
        let heard = [
            Said {
                kept: false,
                ..said(Some(agree), Some(x))
            },
            said(Some(y), Some(x)),
        ];
        assert_eq!(skipped_agreement(&heard), Some(vec![true, false]));
        let heard = [said(Some(z), Some(x)), said(Some(y), Some(x))];
        assert_eq!(skipped_agreement(&heard), None);
        // What a rank says reads back; a bad flag or length says nothing.
        let mut b = [0u8; CHECK_BYTES];
        b[0] = 2;
        b[1..33].copy_from_slice(&y.bytes());
        b[33..].copy_from_slice(&x.bytes());
        assert_eq!(Said::read(&b), said(Some(y), Some(x)));
        b[0] = 3;
        assert_eq!(Said::read(&b), Said::default());
        assert_eq!(Said::read(&b[1..]), Said::default());
    }

    #[test]
    fn an_island_lost_while_the_others_agree_who_comes_back_is_taken_out_and_they_agree() {
        // Three islands of one rank; island 2 was lost and asks to come
        // back (island 0 found it ready). Island 1 dies as the others
        // agree: island 0 takes it out and agrees without it, rather than
        // break the islands' sync.
        let got = on_world(3, 1, Duration::from_secs(10), |r| {
            let rank = r.layout.rank;
            if rank > 0 {
                // Gone without a goodbye: island 0 saw it die first.
                std::thread::sleep(Duration::from_secs(1));
                return None;
            }
            r.counter.contain_deaths(0..1);
            r.counter.declare_dead(1, "killed".into());
            let world = Arc::new(Group::new(GroupKind::World, (0..3).collect()).unwrap());
            let m = Mutex::new(Membership::new(3, 1, rank, 0, world));
            lock(&m).lose(2, 10, "gone".into()).unwrap();
            let back = agree_ready(&m, &r.comm, &[0.0, 0.0, 1.0], 12);
            let lost: Vec<usize> = lock(&m).lost.iter().map(|l| l.island).collect();
            Some((
                back.map_err(|e| e.to_string()),
                lost,
                lock(&m).broken.clone(),
            ))
        });
        let (back, lost, broken) = got[0].clone().unwrap();
        assert_eq!(back, Ok(vec![2]));
        assert_eq!(lost, [2, 1]);
        assert_eq!(broken, None);
    }

    #[test]
    fn a_member_whose_predecessor_gave_up_for_a_third_islands_death_takes_that_island_out() {
        // Three islands of one rank; island 2 dies as an exchange begins
        // (the others see its connection close). Island 0, whose ring
        // predecessor it is, gives up the exchange's call at once; island
        // 1 waits on island 0 for a part it will now never send. Island 0
        // tells it why it gave up, so island 1 too takes out island 2 —
        // not island 0, which it would blame after its timeout — and both
        // run the exchange again without it.
        let got = on_world(3, 1, Duration::from_secs(20), |r| {
            let rank = r.layout.rank;
            if rank == 2 {
                return None;
            }
            r.counter.contain_deaths(rank..rank + 1);
            r.counter.declare_dead(2, "killed".into());
            let kind = GroupKind::Across {
                place: Some(0),
                members: 0,
            };
            let across = Arc::new(Group::new(kind, (0..3).collect()).unwrap());
            let m = Mutex::new(Membership::new(3, 1, rank, 0, across));
            let with = Across {
                members: &m,
                counter: &r.counter,
                quantized: None,
            };
            let name = ExchangeName {
                sync: 0,
                step: 20,
                unit: 0,
                seq: 0,
            };
            let mine = vec![rank as f32 + 1.0; 1000];
            let none = (Residual::none(), Residual::none());
            let averaged = with.exchange(&r.comm, mine, none, name);
            let lost: Vec<usize> = lock(&m).lost.iter().map(|l| l.island).collect();
            Some((averaged.map(|a| a.0).map_err(|e| e.to_string()), lost))
        });
        for (rank, got) in got.into_iter().take(2).enumerate() {
            let (averaged, lost) = got.unwrap();
            assert_eq!(lost, [2], "rank {rank}");
            assert_eq!(averaged, Ok(vec![1.5; 1000]), "rank {rank}");
        }
    }

    #[test]
    fn an_island_lost_and_back_again_talks_under_ids_of_its_own() {
        // Messages of a call given up on the first members' groups may
        // still wait at a rank: once an island is lost and rejoins, the
        // groups of the same islands must not reuse those ids (their calls
        // count from 0 again).
        let all = |m: &Membership| (m.across.id(), m.job.as_ref().map(|j| j.id()));
        let kind = GroupKind::Across {
            place: Some(0),
            members: 0,
        };
        let across = Arc::new(Group::new(kind, vec![0, 2, 4]).unwrap());
        let mut m = Membership::new(3, 2, 0, 0, across);
        let mut seen = vec![all(&m)];
        for (step, lost) in [(10, 1), (20, 2), (30, 1)] {
            m.lose(lost, step, "gone".into()).unwrap();
            seen.push(all(&m));
            m.rejoin(lost, step + 5).unwrap();
            seen.push(all(&m));
        }
        let mut ids: Vec<u32> = seen.iter().map(|s| s.0).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), seen.len(), "{seen:?}");
    }

    #[test]
    fn ranks_at_one_exchange_agree_and_at_two_outer_syncs_units_do_not() {
        let name = ExchangeName {
            sync: 0,
            step: 20,
            unit: 0,
            seq: 1,
        };
        assert!(
            check([name, name])
                .iter()
                .all(|r| r.as_ref().ok() == Some(&Checked::Same))
        );
        // Two outer syncs over the same islands (two models) count their
        // own steps, exchanges and units: unit 0 of each after step 20 is
        // not one exchange.
        let other = ExchangeName { sync: 1, ..name };
        for (rank, r) in check([name, other]).into_iter().enumerate() {
            let e = r
                .expect_err("two outer syncs' exchanges taken for one")
                .to_string();
            assert!(e.contains("different exchanges"), "rank {rank}: {e}");
            let theirs = if rank == 0 {
                "at exchange #1 of unit 0 after step 20 of outer sync 1"
            } else {
                "at exchange #1 of unit 0 after step 20,"
            };
            assert!(e.contains(theirs), "rank {rank}: {e}");
        }
    }
}
