//! Sharded, atomic checkpoints.
//!
//! A checkpoint is a directory `step-NNNNNNNN/` under the checkpoint root:
//! one zstd-compressed shard per rank (`rank-NNNNN.zst`: its fp32 master
//! weights, AdamW moments, error-feedback residuals, its part of the qwZ
//! references and, with islands, its outer state for every unit) and a
//! `manifest.json` written by rank 0 (the run's config, world layout, step,
//! data position, RNG seeding, unit sizes, and each shard's size and CRC-32).
//! Everything is written under `.tmp-step-NNNNNNNN/`, synced, and renamed
//! only when complete, then `latest` names it; a crash or a full disk during
//! a save leaves the previous checkpoint untouched. Every byte read back is
//! checked: sizes and checksums against the manifest, lengths against the
//! manifest's unit sizes, before anything is allocated.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::engine::{Engine, UnitLayout, UnitShard};
use crate::train::config::TrainConfig;
use crate::train::model::Unit;
use crate::zero::delta::SavedReference;
use crate::zero::outer::{Flight, OuterState};
use crate::zero::residual::{self, Residual};
use zeropp_quant::QuantFormat;

/// The manifest's `format` and current `version`.
pub const FORMAT: &str = "zeropp-checkpoint";
/// Version 5 stores error-feedback residuals in int4 blocks (as they are
/// kept, `zero::residual`); version 4 adds the islands' outer state
/// (`zero::outer`); version 3 each rank's part of its qwZ references
/// (`zero::delta`); version 2 stores residuals compressed in int8 blocks;
/// version 1 stored them as f32. All five are read.
pub const VERSION: u32 = 5;
const READS: [u32; 5] = [1, 2, 3, 4, 5];

/// The format a checkpoint of `version` (2 or later) stored its residuals
/// in.
fn residual_format(version: u32) -> QuantFormat {
    match version {
        2..=4 => residual::int8_format(),
        _ => residual::format(),
    }
}
const SHARD_MAGIC: &[u8; 8] = b"ZPPSHRD1";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub rank: usize,
    pub file: String,
    /// Compressed size and CRC-32 of the file.
    pub bytes: u64,
    pub crc32: u32,
    /// Error-feedback residual lengths per unit, in values (0 without
    /// error feedback): the first hop's and the second's.
    pub residual_lens: Vec<(usize, usize)>,
    /// Values of this rank's qwZ reference part per unit (0: none); empty
    /// before version 3.
    #[serde(default)]
    pub reference_lens: Vec<usize>,
    /// Islands (version 4): the shape of each unit's outer state; `None`
    /// without islands.
    #[serde(default)]
    pub outer: Option<Vec<OuterLens>>,
}

/// The shape of one unit's outer state in a shard: anchor and momentum of
/// `values` each, the exchange's two error-feedback residuals as (chunk,
/// count), and whether a finished exchange waits for its step (its weights
/// then and averaged delta, `values` each).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct OuterLens {
    pub values: usize,
    pub sent: (usize, usize),
    pub owned: (usize, usize),
    #[serde(default)]
    pub flight: bool,
}

impl OuterLens {
    fn of(o: &OuterState) -> OuterLens {
        OuterLens {
            values: o.anchor.len(),
            sent: o.sent.shape(),
            owned: o.owned.shape(),
            flight: o.flight.is_some(),
        }
    }

    /// Bytes the state takes in a shard of `version`.
    fn stored(&self, version: u32) -> usize {
        let f = residual_format(version);
        // Saturating: a crafted manifest's sizes give a size no shard has.
        let res =
            |(c, n): (usize, usize)| 8usize.saturating_add(Residual::stored_bytes_as(f, c, n));
        let values = self.values.saturating_mul(8);
        let flight = if self.flight {
            values.saturating_add(8 + 16)
        } else {
            0
        };
        [values, res(self.sent), res(self.owned), flight]
            .into_iter()
            .fold(16, usize::saturating_add)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// Optimizer steps taken; training resumes at step `step + 1`.
    pub step: usize,
    pub nodes: usize,
    pub ranks_per_node: usize,
    pub world_size: usize,
    /// The run's settings (model shape, switches, optimizer, seed, data).
    pub config: TrainConfig,
    /// Where the data stands: batch `step` of every rank is next (batches
    /// are a pure function of seed, rank, world size and step).
    pub data_next_step: usize,
    /// How randomness is seeded: nothing else carries RNG state.
    pub rng: String,
    pub units: Vec<UnitLayout>,
    /// Islands lost before the save: they have no shards, and a rank of
    /// one resumes from the same place of the first island saved.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lost_islands: Vec<usize>,
    /// `--sync-every auto` once chosen: the H and the step it counts
    /// from, which a resume goes on with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub islands_schedule: Option<IslandSchedule>,
    pub shards: Vec<ShardInfo>,
    /// The switches the engine ran with, resolved (hpZ group and qgZ bits
    /// from the routing plan); absent in checkpoints from before they were
    /// recorded.
    #[serde(default)]
    pub switches: Option<crate::zero::plan::Switches>,
}

/// An automatic H as a checkpoint keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct IslandSchedule {
    pub sync_every: usize,
    pub origin: usize,
}

/// The directory name of the checkpoint after `step` steps.
pub fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

fn shard_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.zst")
}

fn put_f32s(out: &mut Vec<u8>, v: &[f32]) {
    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
    out.extend_from_slice(bytemuck::cast_slice(v));
}

/// A shard's bytes before compression.
fn encode_shard(rank: usize, world: usize, units: &[UnitShard]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(SHARD_MAGIC);
    for v in [VERSION, rank as u32, world as u32, units.len() as u32] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    for u in units {
        let l = &u.layout;
        out.extend_from_slice(&(l.name.len() as u32).to_le_bytes());
        out.extend_from_slice(l.name.as_bytes());
        for v in [l.numel, l.padded, l.chunk] {
            out.extend_from_slice(&(v as u64).to_le_bytes());
        }
        for v in [&u.master, &u.m, &u.v] {
            put_f32s(&mut out, v);
        }
        for r in [&u.residual, &u.residual_inter] {
            out.extend_from_slice(&(r.len() as u64).to_le_bytes());
            out.extend_from_slice(&r.to_bytes());
        }
        let (forwards, own) = match &u.reference {
            Some(r) => (r.forwards_since_refresh, &r.own[..]),
            None => (0, &[][..]),
        };
        out.extend_from_slice(&forwards.to_le_bytes());
        put_f32s(&mut out, own);
        if let Some(o) = &u.outer {
            put_f32s(&mut out, &o.anchor);
            put_f32s(&mut out, &o.momentum);
            for r in [&o.sent, &o.owned] {
                out.extend_from_slice(&(r.len() as u64).to_le_bytes());
                out.extend_from_slice(&r.to_bytes());
            }
            if let Some(f) = &o.flight {
                out.extend_from_slice(&f.due.to_le_bytes());
                put_f32s(&mut out, &f.then);
                put_f32s(&mut out, &f.averaged);
            }
        }
    }
    out
}

/// Reads a shard's decompressed bytes, checking every length against the
/// manifest before using it; stored as the manifest's format `version`
/// says.
struct ShardReader<'a> {
    b: &'a [u8],
    at: usize,
    file: &'a str,
    version: u32,
}

impl ShardReader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.b.len() - self.at < n {
            bail!(
                "{}: truncated (needed {n} more bytes at offset {}, {} left)",
                self.file,
                self.at,
                self.b.len() - self.at
            );
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn f32s(&mut self, expected: usize, what: &str) -> Result<Vec<f32>> {
        let n = self.u64()?;
        if n != expected as u64 {
            bail!(
                "{}: {what} holds {n} values, the manifest says {expected}",
                self.file
            );
        }
        Ok(self
            .take(expected * 4)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

impl ShardReader<'_> {
    /// A residual of `len` values in chunks of `chunk`: f32 in version 1,
    /// compressed since version 2.
    fn residual(&mut self, len: usize, chunk: usize, what: &str) -> Result<Residual> {
        if len == 0 {
            self.f32s(0, what)?;
            return Ok(Residual::none());
        }
        if chunk == 0 || !len.is_multiple_of(chunk) {
            bail!(
                "{}: {what} of {len} values is not whole chunks of {chunk}",
                self.file
            );
        }
        let count = len / chunk;
        let file = self.file;
        if self.version == 1 {
            let v = self.f32s(len, what)?;
            return Residual::from_f32(chunk, count, &v)
                .map_err(|e| anyhow!("{file}: {what}: {e}"));
        }
        self.stored_residual((chunk, count), what)
    }

    /// A compressed residual of `count` chunks of `chunk` values, stored
    /// as a checkpoint of the reader's version stores them.
    fn stored_residual(&mut self, (chunk, count): (usize, usize), what: &str) -> Result<Residual> {
        let (file, len, version) = (self.file, chunk * count, self.version);
        let n = self.u64()?;
        if n != len as u64 {
            bail!("{file}: {what} holds {n} values, the manifest says {len}");
        }
        let f = residual_format(version);
        let bytes = self.take(Residual::stored_bytes_as(f, chunk, count))?;
        Residual::from_bytes_as(f, chunk, count, bytes)
            .ok_or_else(|| anyhow!("{file}: {what} has a non-finite or negative scale (corrupt)"))
    }

    /// A unit's outer state of the shape the manifest gives.
    fn outer(&mut self, l: &OuterLens, chunk: usize) -> Result<OuterState> {
        if l.values != chunk {
            bail!(
                "{}: an outer state of {} values, not the unit's chunk of {chunk}",
                self.file,
                l.values
            );
        }
        Ok(OuterState {
            anchor: self.f32s(l.values, "outer anchor")?,
            momentum: self.f32s(l.values, "outer momentum")?,
            sent: self.stored_residual(l.sent, "outer error feedback")?,
            owned: self.stored_residual(l.owned, "outer error feedback")?,
            flight: match l.flight {
                false => None,
                true => Some(Flight {
                    due: self.u64()?,
                    then: self.f32s(l.values, "outer exchange's weights")?,
                    averaged: self.f32s(l.values, "outer exchange's delta")?,
                }),
            },
        })
    }
}

fn decode_shard(b: &[u8], file: &str, m: &Manifest, info: &ShardInfo) -> Result<Vec<UnitShard>> {
    let mut r = ShardReader {
        b,
        at: 0,
        file,
        version: m.version,
    };
    if r.take(8)? != SHARD_MAGIC {
        bail!("{file}: not a zeropp shard (bad magic)");
    }
    let (version, rank, world, n) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
    if version != m.version {
        bail!(
            "{file}: shard format version {version}, its manifest says {}",
            m.version
        );
    }
    if rank as usize != info.rank || world as usize != m.world_size {
        bail!(
            "{file}: shard of rank {rank} of {world}, the manifest expects rank {} of {}",
            info.rank,
            m.world_size
        );
    }
    let references = reference_lens(m, info, file)?;
    if n as usize != m.units.len() || info.residual_lens.len() != m.units.len() {
        bail!("{file}: {n} units, the manifest lists {}", m.units.len());
    }
    let outers = outer_lens(m, info, file)?;
    let mut out = Vec::with_capacity(m.units.len());
    for (((u, &(res, res_inter)), &reference), outer) in m
        .units
        .iter()
        .zip(&info.residual_lens)
        .zip(&references)
        .zip(&outers)
    {
        let len = r.u32()? as usize;
        let name = String::from_utf8_lossy(r.take(len)?).into_owned();
        let (numel, padded, chunk) = (r.u64()?, r.u64()?, r.u64()?);
        if name != u.name
            || (numel, padded, chunk) != (u.numel as u64, u.padded as u64, u.chunk as u64)
        {
            bail!(
                "{file}: unit {name:?} ({numel}/{padded}/{chunk}) differs from the manifest's {:?} ({}/{}/{})",
                u.name,
                u.numel,
                u.padded,
                u.chunk
            );
        }
        out.push(UnitShard {
            layout: u.clone(),
            master: r.f32s(u.chunk, "master weights")?,
            m: r.f32s(u.chunk, "Adam m")?,
            v: r.f32s(u.chunk, "Adam v")?,
            residual: r.residual(res, u.chunk, "error-feedback residual")?,
            residual_inter: r.residual(res_inter, u.chunk, "second-hop residual")?,
            reference: if m.version >= 3 {
                let forwards_since_refresh = r.u64()?;
                let own = r.f32s(reference, "qwZ reference")?;
                (reference > 0).then_some(SavedReference {
                    own,
                    forwards_since_refresh,
                })
            } else {
                None
            },
            outer: match outer {
                Some(l) => Some(r.outer(l, u.chunk)?),
                None => None,
            },
        });
    }
    if r.at != b.len() {
        bail!(
            "{file}: {} unexpected bytes after the last unit",
            b.len() - r.at
        );
    }
    Ok(out)
}

/// Each unit's qwZ reference part in values, as the manifest lists them
/// (zeros before version 3): none, or the unit's chunk.
fn reference_lens(m: &Manifest, info: &ShardInfo, file: &str) -> Result<Vec<usize>> {
    if m.version < 3 {
        return Ok(vec![0; m.units.len()]);
    }
    if info.reference_lens.len() != m.units.len() {
        bail!(
            "{file}: the manifest lists qwZ references for {} units, not {}",
            info.reference_lens.len(),
            m.units.len()
        );
    }
    for (u, &len) in m.units.iter().zip(&info.reference_lens) {
        if len != 0 && len != u.chunk {
            bail!(
                "{file}: unit {:?}: a qwZ reference of {len} values, not its chunk of {}",
                u.name,
                u.chunk
            );
        }
    }
    Ok(info.reference_lens.clone())
}

/// Each unit's outer state shape as the manifest lists it (`None`s
/// without islands or before version 4).
fn outer_lens(m: &Manifest, info: &ShardInfo, file: &str) -> Result<Vec<Option<OuterLens>>> {
    match &info.outer {
        Some(lens) if m.version >= 4 => {
            if lens.len() != m.units.len() {
                bail!(
                    "{file}: the manifest lists outer state for {} units, not {}",
                    lens.len(),
                    m.units.len()
                );
            }
            Ok(lens.iter().copied().map(Some).collect())
        }
        _ => Ok(vec![None; m.units.len()]),
    }
}

/// Decompressed size a shard must have: the bound for decompression.
fn shard_size(m: &Manifest, info: &ShardInfo) -> usize {
    let mut n: usize = 8 + 16;
    let references = reference_lens(m, info, "").unwrap_or_default();
    // Saturating: a crafted manifest's sizes give a size no shard has.
    for (i, (u, &(a, b))) in m.units.iter().zip(&info.residual_lens).enumerate() {
        let states = u.chunk.saturating_mul(4 * 3);
        n = n
            .saturating_add(4 + u.name.len() + 24 + 5 * 8)
            .saturating_add(states);
        for len in [a, b] {
            n = n.saturating_add(match m.version {
                1 => len.saturating_mul(4),
                v => Residual::stored_bytes_as(residual_format(v), u.chunk, len / u.chunk.max(1)),
            });
        }
        if m.version >= 3 {
            let kept = references.get(i).copied().unwrap_or(0).saturating_mul(4);
            n = n.saturating_add(16).saturating_add(kept);
        }
    }
    for l in outer_lens(m, info, "").unwrap_or_default().iter().flatten() {
        n = n.saturating_add(l.stored(m.version));
    }
    n
}

/// Writes `bytes` to `path` and syncs it to disk.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .with_context(|| format!("cannot write {}", path.display()))
}

fn sync_dir(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("cannot sync the directory {}", path.display()))
}

/// What each rank reports to the others after writing its shard.
#[derive(Serialize, Deserialize)]
enum Written {
    Ok(ShardInfo),
    Failed(String),
}

/// What the lead rank tells the others of a step of the save: done, or
/// why not (its error, as it printed it).
#[derive(Serialize, Deserialize)]
enum Verdict {
    Done,
    Failed(String),
}

impl Verdict {
    fn of(r: &anyhow::Result<()>) -> Verdict {
        match r {
            Ok(()) => Verdict::Done,
            Err(e) => Verdict::Failed(format!("{e:#}")),
        }
    }
}

/// Saves every rank's shards after `step` steps under `root` (a collective:
/// every rank calls it). Returns the checkpoint's directory. Any rank's
/// failure is every rank's error, and leaves the previous checkpoint as it
/// was.
pub fn save(
    engine: &Engine,
    cfg: &TrainConfig,
    root: &Path,
    step: usize,
    rank: usize,
    keep: usize,
) -> Result<PathBuf> {
    let world = engine.job_layout().world();
    // The job's first rank leads (with islands, the first of those still
    // taking part; a lost island's ranks save nothing).
    let lead = engine.job_ranks()?[0];
    let name = step_dir_name(step);
    let tmp = root.join(format!(".tmp-{name}"));
    let dest = root.join(&name);
    // Rank 0 prepares an empty temporary directory; a leftover from a crash
    // is removed. Everyone waits for it.
    let prepared = match rank == lead {
        true => Verdict::of(&prepare(root, &tmp)),
        false => Verdict::Done,
    };
    let (ranks, verdicts) = engine.all_gather_bytes(Bytes::from(serde_json::to_vec(&prepared)?))?;
    if ranks[0] != lead {
        bail!(
            "saving the checkpoint of step {step}: rank {lead}'s island was lost while saving \
             (the previous checkpoint is intact)"
        );
    }
    if let Verdict::Failed(e) = serde_json::from_slice(&verdicts[0])? {
        bail!("saving the checkpoint of step {step}: rank {lead}: {e}");
    }

    // Every rank writes and syncs its shard, then all learn how it went.
    let report = match write_shard(engine, rank, world, &tmp) {
        Ok(info) => Written::Ok(info),
        Err(e) => Written::Failed(format!("{e:#}")),
    };
    let (ranks, reports) = engine.all_gather_bytes(Bytes::from(serde_json::to_vec(&report)?))?;
    let mut shards = Vec::with_capacity(world);
    let mut failures = Vec::new();
    for (&r, b) in ranks.iter().zip(&reports) {
        match serde_json::from_slice::<Written>(b) {
            Ok(Written::Ok(info)) => shards.push(info),
            Ok(Written::Failed(e)) => failures.push(format!("rank {r}: {e}")),
            Err(e) => failures.push(format!("rank {r}: unreadable report: {e}")),
        }
    }

    // Rank 0 completes the checkpoint (or removes the attempt), and tells
    // everyone how it went.
    let finished = if rank != lead {
        Verdict::Done
    } else if !failures.is_empty() {
        let _ = std::fs::remove_dir_all(&tmp);
        Verdict::Failed(failures.join("; "))
    } else {
        let manifest = manifest(engine, cfg, step, shards, &ranks);
        let done = finish(root, &tmp, &dest, &name, &manifest, keep);
        if done.is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        Verdict::of(&done)
    };
    let (ranks, verdicts) = engine.all_gather_bytes(Bytes::from(serde_json::to_vec(&finished)?))?;
    if ranks[0] != lead {
        bail!("saving the checkpoint of step {step}: rank {lead}'s island was lost while saving");
    }
    match serde_json::from_slice(&verdicts[0])? {
        Verdict::Done => Ok(dest),
        Verdict::Failed(e) => bail!(
            "saving the checkpoint of step {step} failed ({e}); the previous checkpoint in {} is intact",
            root.display()
        ),
    }
}

/// An empty temporary directory `tmp` under `root`; the leftovers of saves
/// a crash interrupted (any `.tmp-step-*`, as large as a checkpoint) are
/// removed.
fn prepare(root: &Path, tmp: &Path) -> Result<()> {
    std::fs::create_dir_all(root).with_context(|| format!("cannot create {}", root.display()))?;
    let leftovers = std::fs::read_dir(root)
        .with_context(|| format!("cannot read {}", root.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-step-"))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()));
    for e in leftovers {
        let p = e.path();
        std::fs::remove_dir_all(&p).with_context(|| format!("cannot remove {}", p.display()))?;
    }
    std::fs::create_dir(tmp).with_context(|| format!("cannot create {}", tmp.display()))
}

/// This rank's shard written (compressed) and synced under `tmp`, and
/// what the manifest says of it.
fn write_shard(engine: &Engine, rank: usize, world: usize, tmp: &Path) -> Result<ShardInfo> {
    let units = engine.shard_state()?;
    let raw = encode_shard(rank, world, &units);
    let packed = zstd::encode_all(&raw[..], 3).context("compressing the shard")?;
    let file = shard_file_name(rank);
    write_synced(&tmp.join(&file), &packed)?;
    Ok(ShardInfo {
        rank,
        file,
        bytes: packed.len() as u64,
        crc32: crc32fast::hash(&packed),
        residual_lens: units
            .iter()
            .map(|u| (u.residual.len(), u.residual_inter.len()))
            .collect(),
        reference_lens: units
            .iter()
            .map(|u| u.reference.as_ref().map_or(0, |r| r.own.len()))
            .collect(),
        outer: units
            .iter()
            .map(|u| u.outer.as_ref().map(OuterLens::of))
            .collect(),
    })
}

/// The manifest of the checkpoint of `step` whose `shards` the ranks
/// `saved` wrote.
fn manifest(
    engine: &Engine,
    cfg: &TrainConfig,
    step: usize,
    shards: Vec<ShardInfo>,
    saved: &[usize],
) -> Manifest {
    let layout = engine.job_layout();
    let world = layout.world();
    Manifest {
        format: FORMAT.into(),
        version: VERSION,
        step,
        nodes: layout.nodes,
        ranks_per_node: layout.ranks_per_node,
        world_size: world,
        config: cfg.clone(),
        data_next_step: step,
        rng: "stochastic rounding is seeded by (seed, step, unit, rank); \
              initial weights by (seed, unit); no other RNG state"
            .into(),
        units: engine.unit_layouts(),
        lost_islands: lost_islands(world, engine.islands().map_or(1, |(c, _)| c.count), saved),
        islands_schedule: engine.island_schedule().and_then(|(h, origin, why)| {
            why.map(|_| IslandSchedule {
                sync_every: h,
                origin,
            })
        }),
        shards,
        switches: Some(engine.switches().clone()),
    }
}

/// The islands of a job of `world` ranks cut into `islands` none of whose
/// ranks is among `saved`.
fn lost_islands(world: usize, islands: usize, saved: &[usize]) -> Vec<usize> {
    let size = world / islands.max(1);
    (0..islands)
        .filter(|i| !saved.iter().any(|r| r / size == *i))
        .collect()
}

/// The lead: the manifest, the rename, `latest`, and pruning to `keep`.
fn finish(
    root: &Path,
    tmp: &Path,
    dest: &Path,
    name: &str,
    manifest: &Manifest,
    keep: usize,
) -> Result<()> {
    write_synced(
        &tmp.join("manifest.json"),
        &serde_json::to_vec_pretty(manifest)?,
    )?;
    sync_dir(tmp)?;
    if dest.exists() {
        // Saving a step again (e.g. after resuming from it): the new copy
        // replaces the old only once complete.
        let old = root.join(format!(".old-{name}"));
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(dest, &old)
            .with_context(|| format!("cannot move {} aside", dest.display()))?;
        std::fs::rename(tmp, dest)
            .with_context(|| format!("cannot rename to {}", dest.display()))?;
        let _ = std::fs::remove_dir_all(&old);
    } else {
        std::fs::rename(tmp, dest)
            .with_context(|| format!("cannot rename to {}", dest.display()))?;
    }
    let latest_tmp = root.join(".latest.tmp");
    write_synced(&latest_tmp, name.as_bytes())?;
    std::fs::rename(&latest_tmp, root.join("latest")).context("cannot update latest")?;
    sync_dir(root)?;
    prune(root, name, keep)
}

/// Keeps the `keep` newest checkpoints up to `saved` (the one just saved
/// among them; 0: all): only earlier steps are removed. Later steps in
/// `root` are another run's (an earlier run that went further, or a branch
/// resumed from before them): never this save's to delete — a resume from
/// step 3 of 3, 6, 9 keeps step 3, its restore point.
fn prune(root: &Path, saved: &str, keep: usize) -> Result<()> {
    if keep == 0 {
        return Ok(());
    }
    let mut earlier: Vec<String> = std::fs::read_dir(root)?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with("step-") && n.len() == 13 && n.as_str() < saved)
        .collect();
    earlier.sort();
    let excess = (earlier.len() + 1).saturating_sub(keep);
    for old in &earlier[..excess] {
        std::fs::remove_dir_all(root.join(old))
            .with_context(|| format!("cannot prune {}", root.join(old).display()))?;
    }
    Ok(())
}

/// The checkpoint directory `path` names: a checkpoint itself (it holds
/// `manifest.json`) or a checkpoint root (its `latest`).
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join("manifest.json").is_file() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join("latest");
    if latest.is_file() {
        let name = std::fs::read_to_string(&latest)
            .with_context(|| format!("cannot read {}", latest.display()))?;
        let name = name.trim();
        if name.is_empty() || name.contains('/') || name.contains("..") {
            bail!(
                "{}: does not name a checkpoint ({name:?}){}",
                latest.display(),
                others_here(path)
            );
        }
        let dir = path.join(name);
        if !dir.join("manifest.json").is_file() {
            bail!(
                "{} names {name}, which has no manifest.json{}",
                latest.display(),
                others_here(path)
            );
        }
        return Ok(dir);
    }
    // `zeropp train --compare --checkpoint-dir D` keeps one directory per
    // mode inside D.
    let inside: Vec<String> = dirs_holding(path, "latest")
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    let hint = match inside.as_slice() {
        // Checkpoints whose `latest` is gone are still whole.
        [] => others_here(path),
        dirs => format!(
            "; it holds checkpoint directories (a --compare run's, one per mode): {}",
            dirs.join(", ")
        ),
    };
    bail!(
        "no checkpoint at {}: expected a manifest.json (a checkpoint) or a latest file (a \
         checkpoint directory){hint}",
        path.display()
    )
}

/// The directories inside `root` that hold `file`, by name.
fn dirs_holding(root: &Path, file: &str) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|d| d.join(file).is_file())
        .collect();
    dirs.sort();
    dirs
}

/// Refuses a run that starts afresh (not a resume) in a checkpoint
/// directory holding an earlier run's checkpoints: its saves would mix
/// with them (a step of the same number replaced, `latest` moved between
/// runs) and its pruning remove them.
pub fn check_fresh_dir(root: &Path) -> Result<()> {
    let steps: Vec<String> = dirs_holding(root, "manifest.json")
        .iter()
        .filter_map(|d| d.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .collect();
    let Some(newest) = steps.last() else {
        return Ok(());
    };
    bail!(
        "--checkpoint-dir {}: it holds an earlier run's checkpoints ({}); continue that run with \
         --resume {} (its newest: {newest}), or give this run a directory of its own (or remove \
         them)",
        root.display(),
        steps.join(", "),
        root.display()
    )
}

/// The checkpoints beside a `latest` that names none, newest first, as a
/// hint to resume one of them (empty when there is none).
fn others_here(root: &Path) -> String {
    let steps: Vec<String> = dirs_holding(root, "manifest.json")
        .iter()
        .rev()
        .filter_map(|d| d.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .collect();
    match steps.first() {
        None => String::new(),
        Some(newest) => format!(
            "; checkpoints here: {} (name one by its path, e.g. {})",
            steps.join(", "),
            root.join(newest).display()
        ),
    }
}

/// Reads and checks a checkpoint's manifest.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join("manifest.json");
    let text = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    if text.len() > 64 << 20 {
        bail!("{}: {} bytes is not a manifest", path.display(), text.len());
    }
    let m: Manifest = serde_json::from_slice(&text)
        .map_err(|e| anyhow!("{}: not a zeropp manifest: {e}", path.display()))?;
    if m.format != FORMAT {
        bail!(
            "{}: format {:?}, expected {FORMAT:?}",
            path.display(),
            m.format
        );
    }
    if !READS.contains(&m.version) {
        bail!(
            "{}: checkpoint format version {}, this build reads versions 1 to {VERSION}",
            path.display(),
            m.version
        );
    }
    let saved: Vec<usize> = if m.world_size == m.nodes * m.ranks_per_node {
        saved_ranks(&m)
            .map_err(|e| anyhow!("{}: {e}", path.display()))?
            .collect()
    } else {
        Vec::new()
    };
    if m.world_size != m.nodes * m.ranks_per_node || m.shards.len() != saved.len() {
        bail!(
            "{}: {} shards for {} (world size {}{})",
            path.display(),
            m.shards.len(),
            crate::comm::shape(m.nodes, m.ranks_per_node),
            m.world_size,
            if m.lost_islands.is_empty() {
                String::new()
            } else {
                format!(", islands {:?} lost", m.lost_islands)
            }
        );
    }
    for (&r, s) in saved.iter().zip(&m.shards) {
        if s.rank != r || s.file != shard_file_name(r) {
            bail!(
                "{}: the shard of rank {r} is listed as {:?}",
                path.display(),
                s.file
            );
        }
    }
    Ok(m)
}

/// Reads rank `rank`'s shard, checking size, checksum and contents.
/// A rank of a lost island reads the shard of its place in the first
/// island saved.
pub fn read_shard(dir: &Path, m: &Manifest, rank: usize) -> Result<Vec<UnitShard>> {
    let (info, path) = shard_on_disk(dir, m, rank)?;
    let shown = path.display().to_string();
    let packed = std::fs::read(&path).with_context(|| format!("cannot read {shown}"))?;
    let crc = crc32fast::hash(&packed);
    if crc != info.crc32 {
        bail!(
            "{shown}: checksum {crc:08x}, the manifest says {:08x} (the file is corrupt)",
            info.crc32
        );
    }
    let expected = shard_size(m, info);
    // Grown as the data decompresses: a manifest's sizes alone (a crafted
    // one's) never size an allocation.
    let mut raw = Vec::with_capacity(expected.min(packed.len().saturating_mul(8)));
    zstd::stream::read::Decoder::new(&packed[..])
        .with_context(|| format!("{shown}: not zstd data"))?
        .take(expected as u64 + 1)
        .read_to_end(&mut raw)
        .with_context(|| format!("{shown}: cannot decompress"))?;
    if raw.len() != expected {
        bail!(
            "{shown}: {} bytes decompressed, the manifest implies {expected}",
            raw.len()
        );
    }
    decode_shard(&raw, &shown, m, info)
}

/// Rank `rank`'s shard (a lost island's rank: its stand-in's), there and
/// of the size the manifest says.
fn shard_on_disk<'m>(dir: &Path, m: &'m Manifest, rank: usize) -> Result<(&'m ShardInfo, PathBuf)> {
    let rank = stand_in(m, rank)?;
    let info = m
        .shards
        .iter()
        .find(|s| s.rank == rank)
        .ok_or_else(|| anyhow!("the checkpoint has no shard for rank {rank}"))?;
    let path = dir.join(&info.file);
    let shown = path.display().to_string();
    let meta =
        std::fs::metadata(&path).with_context(|| format!("missing shard {shown} (rank {rank})"))?;
    if meta.len() != info.bytes {
        bail!(
            "{shown}: {} bytes, the manifest says {} (truncated or replaced)",
            meta.len(),
            info.bytes
        );
    }
    Ok((info, path))
}

/// A resume from step `start` trains up to step `end` (the run's
/// --stop-after or --steps): at least one step.
pub fn steps_left(start: usize, end: usize) -> Result<()> {
    if start >= end {
        bail!(
            "the checkpoint is at step {start} and this run would stop at step {end}: raise \
             --steps (or --stop-after) to train further"
        );
    }
    Ok(())
}

/// What a resume from `path` to step `end` on `world` ranks in `islands`
/// islands needs, checked once before any rank starts: the manifest
/// reads, its units are its model's, the shards the ranks will read are
/// there at their size (each rank checks the checksum as it reads), and
/// steps are left to train. The same world and islands read every saved
/// shard; any other re-cuts island 0's places ([`state_for`]).
pub fn check_resume(path: &Path, end: usize, (world, islands): (usize, usize)) -> Result<()> {
    let dir = resolve(path)?;
    let m = read_manifest(&dir)?;
    check_units(&dir, &m)?;
    let read: Vec<usize> = if m.world_size == world && islands_of(&m) == islands {
        saved_ranks(&m)?.collect()
    } else {
        (0..island_size(&m)?).collect()
    };
    for rank in read {
        shard_on_disk(&dir, &m, rank)?;
    }
    steps_left(m.step, end)
}

/// Verifies a checkpoint (`zeropp ckpt inspect`): its units are the
/// model's it describes, and every shard reads back.
pub fn verify(dir: &Path, m: &Manifest) -> Result<()> {
    check_units(dir, m)?;
    read_all_shards(dir, m).map(drop)
}

/// The manifest's units are those of the model it describes (names and
/// sizes), with the file to blame when they are not.
fn check_units(dir: &Path, m: &Manifest) -> Result<Vec<Unit>> {
    let c = &m.config.model;
    let manifest = dir.join("manifest.json");
    c.validate().map_err(|e| {
        anyhow!(
            "{}: the model it describes is invalid: {e}",
            manifest.display()
        )
    })?;
    let units = c.units();
    let expect: Vec<(String, usize)> = units.iter().map(|u| (u.name(), u.numel(c))).collect();
    let have: Vec<(String, usize)> = m.units.iter().map(|u| (u.name.clone(), u.numel)).collect();
    if expect != have {
        bail!(
            "{}: its units {have:?} are not those of the model it describes ({expect:?}): \
             the manifest was edited or comes from another checkpoint",
            manifest.display()
        );
    }
    Ok(units)
}

fn read_all_shards(dir: &Path, m: &Manifest) -> Result<Vec<Vec<UnitShard>>> {
    saved_ranks(m)?.map(|r| read_shard(dir, m, r)).collect()
}

/// The ranks whose shards the checkpoint holds: every rank's but those
/// of its lost islands.
fn saved_ranks(m: &Manifest) -> Result<impl Iterator<Item = usize> + '_> {
    let size = island_size(m)?;
    Ok((0..m.world_size).filter(move |r| !m.lost_islands.contains(&(r / size))))
}

/// Ranks per island of the checkpointed job.
fn island_size(m: &Manifest) -> Result<usize> {
    let islands = islands_of(m);
    if !m.world_size.is_multiple_of(islands) || m.lost_islands.iter().any(|&i| i >= islands) {
        bail!(
            "the manifest says {} ranks in {islands} islands, lost {:?}: it is corrupt or edited",
            m.world_size,
            m.lost_islands
        );
    }
    Ok(m.world_size / islands)
}

/// The rank whose shard `rank` resumes from: its own, or for a rank of a
/// lost island the same place of the first island saved.
fn stand_in(m: &Manifest, rank: usize) -> Result<usize> {
    let size = island_size(m)?;
    if !m.lost_islands.contains(&(rank / size)) {
        return Ok(rank);
    }
    let first = (0..islands_of(m))
        .find(|i| !m.lost_islands.contains(i))
        .ok_or_else(|| anyhow!("the manifest says every island was lost: it is corrupt"))?;
    Ok(first * size + rank % size)
}

/// Islands the checkpointed job was cut into (1: none; a save records the
/// count an `auto` run chose).
pub fn islands_of(m: &Manifest) -> usize {
    m.config.islands.islands.number().unwrap_or(1).max(1)
}

/// The shards of the checkpoint's first island: the whole model once
/// (every island holds all of it; after an outer sync the same weights).
fn read_island_shards(dir: &Path, m: &Manifest) -> Result<Vec<Vec<UnitShard>>> {
    // Island 0's places: a lost island 0 reads the first island saved.
    (0..island_size(m)?)
        .map(|r| read_shard(dir, m, r))
        .collect()
}

/// Unit `u`'s full (unpadded) buffer of one kind of state, from every
/// rank's shard.
fn assemble(all: &[Vec<UnitShard>], u: usize, pick: fn(&UnitShard) -> &Vec<f32>) -> Vec<f32> {
    let mut full: Vec<f32> = all
        .iter()
        .flat_map(|shard| pick(&shard[u]))
        .copied()
        .collect();
    full.truncate(all[0][u].layout.numel);
    full
}

/// Every unit's full (unpadded) master weights, from all shards.
/// Every unit's full weights, checked against the model the manifest
/// describes (names and sizes), with the file to blame when they disagree.
pub fn unit_weights(dir: &Path, m: &Manifest) -> Result<Vec<(Unit, Vec<f32>)>> {
    let units = check_units(dir, m)?;
    let weights = full_weights(dir, m)?;
    Ok(units
        .into_iter()
        .zip(weights)
        .map(|(u, (_, w))| (u, w))
        .collect())
}

pub fn full_weights(dir: &Path, m: &Manifest) -> Result<Vec<(UnitLayout, Vec<f32>)>> {
    let all = read_island_shards(dir, m)?;
    Ok(m.units
        .iter()
        .enumerate()
        .map(|(u, layout)| (layout.clone(), assemble(&all, u, |s| &s.master)))
        .collect())
}

/// This rank's state from a checkpoint: its own shard when the job is cut
/// as it was (`layouts`: this engine's units, `job`: the job's layout,
/// `islands`, `place`: this rank's place in its island), else re-cut:
/// each unit's full buffers are assembled from the first island's shards
/// and cut for `layouts` at `place`. Error-feedback residuals and outer
/// state are per-rank and cannot be re-cut: they restart then (the outer
/// anchor from the weights loaded).
pub fn state_for(
    dir: &Path,
    m: &Manifest,
    layouts: &[UnitLayout],
    job: crate::zero::layout::Layout,
    islands: usize,
    place: usize,
) -> Result<Vec<UnitShard>> {
    let same_model = layouts.len() == m.units.len()
        && layouts
            .iter()
            .zip(&m.units)
            .all(|(a, b)| a.name == b.name && a.numel == b.numel);
    if !same_model {
        let mine: Vec<_> = layouts.iter().map(|u| (&u.name, u.numel)).collect();
        let theirs: Vec<_> = m.units.iter().map(|u| (&u.name, u.numel)).collect();
        bail!(
            "the checkpoint's model does not match this one: units {theirs:?} vs {mine:?} \
             (resume with the checkpoint's model shape)"
        );
    }
    if layouts == m.units.as_slice() && m.world_size == job.world() && islands_of(m) == islands {
        // Same padding and chunks on the same islands: this rank's shard.
        return read_shard(dir, m, job.rank);
    }
    let all = read_island_shards(dir, m)?;
    let rank = place;
    Ok(layouts
        .iter()
        .enumerate()
        .map(|(u, layout)| {
            let cut = |pick: fn(&UnitShard) -> &Vec<f32>| {
                let mut full = assemble(&all, u, pick);
                full.resize(layout.padded, 0.0);
                full[rank * layout.chunk..(rank + 1) * layout.chunk].to_vec()
            };
            UnitShard {
                layout: layout.clone(),
                master: cut(|s| &s.master),
                m: cut(|s| &s.m),
                v: cut(|s| &s.v),
                residual: Residual::none(),
                residual_inter: Residual::none(),
                reference: None,
                outer: None,
            }
        })
        .collect())
}

/// Writes the checkpoint's full model (fp32, named like
/// `blocks.0.attn.qkv.weight`) as one safetensors file. Returns the number
/// of tensors.
pub fn export(dir: &Path, m: &Manifest, out: &Path) -> Result<usize> {
    let model = &m.config.model;
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for (unit, flat) in unit_weights(dir, m)? {
        let mut off = 0;
        for p in unit.params(model) {
            let n = p.numel();
            tensors.push((
                format!("{}.{}", unit.name(), p.name),
                p.shape.clone(),
                flat[off..off + n].to_vec(),
            ));
            off += n;
        }
    }
    write_safetensors(out, &tensors, None)?;
    Ok(tensors.len())
}

/// Writes f32 tensors `(name, shape, values)` to `path` as one safetensors
/// file, with `meta` in its header (transformers wants `format: pt`).
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    meta: Option<std::collections::HashMap<String, String>>,
) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(name, shape, values)| {
            let bytes: &[u8] = bytemuck::cast_slice(values);
            Ok((
                name.clone(),
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    shape.clone(),
                    bytes,
                )?,
            ))
        })
        .collect::<std::result::Result<Vec<_>, safetensors::SafeTensorError>>()?;
    write_safetensors_views(views, meta, path)
}

/// `views` written to `path` as safetensors, readable as any new file of
/// this process is (the crate's file is made owner-only: a shared
/// cluster's users could not load an export).
pub fn write_safetensors_views<'a>(
    views: Vec<(String, safetensors::tensor::TensorView<'a>)>,
    meta: Option<std::collections::HashMap<String, String>>,
    path: &Path,
) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    safetensors::serialize_to_file(views, meta, path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    // The umask new files get (Linux says it in /proc since 4.7; where it
    // does not, the file stays as the crate made it).
    let umask = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("Umask:"))?;
            u32::from_str_radix(line["Umask:".len()..].trim(), 8).ok()
        });
    match umask {
        Some(umask) => {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666 & !umask))
                .with_context(|| format!("cannot set the permissions of {}", path.display()))
        }
        None => Ok(()),
    }
}

/// The human view of `zeropp ckpt inspect`.
pub fn describe(dir: &Path, m: &Manifest) -> String {
    let mut s = format!(
        "checkpoint {}\n  format {} v{}, step {}, {} (world {})\n  mode {}, switches {}\n  model {}\n  seed {}, next data step {}\n  rng: {}\n  units:\n",
        dir.display(),
        m.format,
        m.version,
        m.step,
        crate::comm::shape(m.nodes, m.ranks_per_node),
        m.world_size,
        m.config.switches.mode,
        serde_json::to_string(&m.switches.clone().unwrap_or_else(|| m.config.switches()))
            .unwrap_or_default(),
        serde_json::to_string(&m.config.model).unwrap_or_default(),
        m.config.run.seed,
        m.data_next_step,
        m.rng
    );
    for u in &m.units {
        s += &format!(
            "    {:<12} {:>10} params, padded {:>10}, {:>9} per rank\n",
            u.name, u.numel, u.padded, u.chunk
        );
    }
    if !m.lost_islands.is_empty() {
        s += &format!(
            "  islands lost before the save: {:?} (no shards; their ranks resume from the same \
             places of the first island saved)\n",
            m.lost_islands
        );
    }
    s += "  shards:\n";
    for sh in &m.shards {
        s += &format!(
            "    {} {:>12} bytes crc32 {:08x}\n",
            sh.file, sh.bytes, sh.crc32
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of checkpoint directories (a `--compare` run's) is not
    /// one: the error lists them.
    #[test]
    fn a_directory_of_checkpoint_directories_is_named_with_them() {
        let root = std::env::temp_dir().join(format!("zeropp-compare-ck-{}", std::process::id()));
        for mode in ["zero3", "zeropp"] {
            std::fs::create_dir_all(root.join(mode)).unwrap();
            std::fs::write(root.join(mode).join("latest"), "step-00000005").unwrap();
        }
        let e = resolve(&root).unwrap_err().to_string();
        assert!(
            e.contains("a --compare run's") && e.contains("zero3") && e.contains("zeropp"),
            "{e}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// Pruning removes only steps before the one just saved: a resume from
    /// an earlier step keeps its restore point and never deletes what it
    /// saved, whatever later steps another run left.
    #[test]
    fn pruning_keeps_the_save_and_never_touches_later_steps() {
        let root = std::env::temp_dir().join(format!("zeropp-prune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let steps = |names: &[&str]| {
            for n in names {
                std::fs::create_dir_all(root.join(n)).unwrap();
            }
        };
        let left = || {
            let mut v: Vec<String> = std::fs::read_dir(&root)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            v.sort();
            v
        };
        // An earlier run saved 3, 6, 9; this one resumed from 3 and saves 4.
        steps(&[
            "step-00000003",
            "step-00000006",
            "step-00000009",
            "step-00000004",
        ]);
        prune(&root, "step-00000004", 3).unwrap();
        assert_eq!(
            left(),
            [
                "step-00000003",
                "step-00000004",
                "step-00000006",
                "step-00000009"
            ]
        );
        prune(&root, "step-00000004", 1).unwrap();
        assert_eq!(left(), ["step-00000004", "step-00000006", "step-00000009"]);
        // A new run into a directory of later steps saves step 2.
        steps(&["step-00000002"]);
        prune(&root, "step-00000002", 1).unwrap();
        assert!(
            left().contains(&"step-00000002".to_string()),
            "{:?}",
            left()
        );
        // Steps in order: the newest `keep` stay; 0 keeps all.
        steps(&["step-00000010", "step-00000011", "step-00000012"]);
        prune(&root, "step-00000012", 0).unwrap();
        assert_eq!(left().len(), 7);
        prune(&root, "step-00000012", 2).unwrap();
        assert_eq!(left(), ["step-00000011", "step-00000012"]);
        std::fs::remove_dir_all(&root).unwrap();
    }

    fn manifest(
        version: u32,
        layout: &UnitLayout,
        res: (usize, usize),
        reference: usize,
    ) -> Manifest {
        Manifest {
            format: FORMAT.into(),
            version,
            step: 1,
            nodes: 2,
            ranks_per_node: 2,
            world_size: 4,
            config: TrainConfig::default(),
            data_next_step: 1,
            rng: String::new(),
            units: vec![layout.clone()],
            lost_islands: Vec::new(),
            islands_schedule: None,
            shards: (0..4)
                .map(|r| ShardInfo {
                    rank: r,
                    file: shard_file_name(r),
                    bytes: 0,
                    crc32: 0,
                    residual_lens: vec![res],
                    reference_lens: if version >= 3 {
                        vec![reference]
                    } else {
                        vec![]
                    },
                    outer: None,
                })
                .collect(),
            switches: None,
        }
    }

    /// Shards store residuals compressed (since version 2) and the qwZ
    /// reference part (version 3), read back bit for bit; version-1 shards
    /// (f32 residuals, no references) still load, compressed on the way in.
    #[test]
    fn residuals_and_references_round_trip_and_v1_still_loads() {
        let (layout, values) = unit_of_four_chunks();
        let inter: Vec<f32> = values[..128].to_vec();
        let shard = UnitShard {
            layout: layout.clone(),
            master: vec![1.0; 64],
            m: vec![2.0; 64],
            v: vec![3.0; 64],
            residual: Residual::from_f32(64, 4, &values).unwrap(),
            residual_inter: Residual::from_f32(64, 2, &inter).unwrap(),
            reference: Some(SavedReference {
                own: values[..64].to_vec(),
                forwards_since_refresh: 7,
            }),
            outer: None,
        };
        let m = manifest(VERSION, &layout, (256, 128), 64);
        let raw = encode_shard(1, 4, std::slice::from_ref(&shard));
        assert_eq!(raw.len(), shard_size(&m, &m.shards[1]));
        let back = decode_shard(&raw, "rank-00001.zst", &m, &m.shards[1]).unwrap();
        assert_eq!(back, vec![shard.clone()]);
        // A reference that is not the unit's chunk is refused before use.
        let bad = manifest(VERSION, &layout, (256, 128), 32);
        let e = decode_shard(&raw, "rank-00001.zst", &bad, &bad.shards[1]).unwrap_err();
        assert!(format!("{e}").contains("not its chunk of 64"), "{e}");
        // Without a reference (before the first gather): none comes back.
        let plain = UnitShard {
            reference: None,
            ..shard.clone()
        };
        let m0 = manifest(VERSION, &layout, (256, 128), 0);
        let raw = encode_shard(1, 4, std::slice::from_ref(&plain));
        assert_eq!(raw.len(), shard_size(&m0, &m0.shards[1]));
        let back = decode_shard(&raw, "rank-00001.zst", &m0, &m0.shards[1]).unwrap();
        assert_eq!(back, vec![plain]);

        // The same shard as version 1 wrote it: residuals as f32.
        let mut v1 = shard_head(1, &layout);
        for v in [&shard.master, &shard.m, &shard.v, &values, &inter] {
            put_f32s(&mut v1, v);
        }
        let m1 = manifest(1, &layout, (256, 128), 0);
        assert_eq!(v1.len(), shard_size(&m1, &m1.shards[1]));
        let old = decode_shard(&v1, "rank-00001.zst", &m1, &m1.shards[1]).unwrap();
        assert_eq!(old[0].master, shard.master);
        assert_eq!(old[0].residual, shard.residual);
        assert_eq!(old[0].reference, None);
        // A shard whose version is not its manifest's is refused, named.
        let e = decode_shard(&v1, "rank-00001.zst", &m, &m.shards[1]).unwrap_err();
        assert!(format!("{e}").contains("rank-00001.zst"), "{e}");
    }

    /// A version-4 shard (residuals in int8 blocks of 32, as versions 2 to
    /// 4 stored them) still loads: its residuals are kept in this build's
    /// int4 blocks, to within what int4 keeps of the int8 values.
    #[test]
    fn a_version_4_shard_with_int8_residuals_still_loads() {
        let (layout, values) = unit_of_four_chunks();
        let int8 = |v: &[f32]| int8_residual(64, v);
        let mut v4 = shard_head(4, &layout);
        for v in [1.0, 2.0, 3.0] {
            put_f32s(&mut v4, &[v; 64]);
        }
        v4.extend_from_slice(&int8(&values));
        v4.extend_from_slice(&int8(&values[..128]));
        v4.extend_from_slice(&7u64.to_le_bytes());
        put_f32s(&mut v4, &values[..64]);
        let m4 = manifest(4, &layout, (256, 128), 64);
        assert_eq!(v4.len(), shard_size(&m4, &m4.shards[1]));
        let old = decode_shard(&v4, "rank-00001.zst", &m4, &m4.shards[1]).unwrap();
        assert_eq!(old[0].v, vec![3.0; 64]);
        assert_eq!(old[0].residual.shape(), (64, 4));
        assert_eq!(old[0].residual_inter.shape(), (64, 2));
        assert_eq!(old[0].residual.bytes(), Residual::zeros(64, 4).bytes());
        // int8 then int4: within 1/254 + 1/14 of each block's largest.
        let back = old[0].residual.to_f32();
        for (b, v) in back.iter().zip(&values) {
            assert!(
                (b - v).abs() <= 1.01e-3 * (1.0 / 254.0 + 1.0 / 14.0),
                "{b} vs {v}"
            );
        }
        assert_eq!(old[0].reference.as_ref().unwrap().own, &values[..64]);
        // The same bytes claiming this version: int8 residuals are not
        // int4's length, so what follows is misplaced and refused, named.
        let mut v5 = v4.clone();
        v5[8..12].copy_from_slice(&VERSION.to_le_bytes());
        let m5 = manifest(VERSION, &layout, (256, 128), 64);
        let e = decode_shard(&v5, "rank-00001.zst", &m5, &m5.shards[1]).unwrap_err();
        assert!(format!("{e}").contains("rank-00001.zst"), "{e}");
        assert!(!format!("{e}").contains("version"), "{e}");
    }

    /// A unit of 250 values (4 chunks of 64 with padding) and 4 chunks of
    /// small residual-like values.
    fn unit_of_four_chunks() -> (UnitLayout, Vec<f32>) {
        let layout = UnitLayout {
            name: "blocks.0".into(),
            numel: 250,
            padded: 256,
            chunk: 64,
        };
        let values = (0..64 * 4)
            .map(|i| (i as f32 * 0.37).sin() * 1e-3)
            .collect();
        (layout, values)
    }

    /// A shard's start as `version` wrote it for rank 1 of 4, holding one
    /// unit: `layout`.
    fn shard_head(version: u32, layout: &UnitLayout) -> Vec<u8> {
        let mut b = SHARD_MAGIC.to_vec();
        for v in [version, 1, 4, 1] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&(layout.name.len() as u32).to_le_bytes());
        b.extend_from_slice(layout.name.as_bytes());
        for v in [layout.numel, layout.padded, layout.chunk] {
            b.extend_from_slice(&(v as u64).to_le_bytes());
        }
        b
    }

    /// What versions 2 to 4 stored of a residual of `v.len()` values in
    /// chunks of `chunk`: its length, then int8 blocks of 32 (codes, then
    /// one f32 scale a block).
    fn int8_residual(chunk: usize, v: &[f32]) -> Vec<u8> {
        let count = v.len() / chunk;
        let mut q = zeropp_quant::QuantizedChunks::zeroed(residual::int8_format(), chunk, count);
        for p in 0..count {
            let values = &v[p * chunk..(p + 1) * chunk];
            zeropp_quant::quantize(values, zeropp_quant::Rounding::NearestEven, q.chunk_mut(p))
                .unwrap();
        }
        let mut b = (v.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(&q.codes);
        q.block_max
            .iter()
            .for_each(|m| b.extend_from_slice(&m.to_le_bytes()));
        b
    }

    /// With islands (version 4) each unit's outer state (anchor, momentum,
    /// the exchange's error feedback) round-trips bit for bit; a shard
    /// cut short inside it is refused, named.
    #[test]
    fn the_islands_outer_state_round_trips() {
        let layout = UnitLayout {
            name: "blocks.0".into(),
            numel: 128,
            padded: 128,
            chunk: 64,
        };
        let values: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let outer = OuterState {
            anchor: values.clone(),
            momentum: values.iter().map(|v| v * 0.5).collect(),
            sent: Residual::from_f32(32, 2, &values).unwrap(),
            owned: Residual::from_f32(32, 1, &values[..32]).unwrap(),
            flight: Some(Flight {
                due: 17,
                then: values.iter().map(|v| v + 1.0).collect(),
                averaged: values.iter().map(|v| v * 0.25).collect(),
            }),
        };
        let shard = UnitShard {
            layout: layout.clone(),
            master: vec![1.0; 64],
            m: vec![2.0; 64],
            v: vec![3.0; 64],
            residual: Residual::none(),
            residual_inter: Residual::none(),
            reference: None,
            outer: Some(outer.clone()),
        };
        let mut m = manifest(VERSION, &layout, (0, 0), 0);
        for info in &mut m.shards {
            info.outer = Some(vec![OuterLens::of(&outer)]);
        }
        let raw = encode_shard(1, 4, std::slice::from_ref(&shard));
        assert_eq!(raw.len(), shard_size(&m, &m.shards[1]));
        let back = decode_shard(&raw, "rank-00001.zst", &m, &m.shards[1]).unwrap();
        assert_eq!(back, vec![shard.clone()]);
        let e =
            decode_shard(&raw[..raw.len() - 3], "rank-00001.zst", &m, &m.shards[1]).unwrap_err();
        assert!(format!("{e}").contains("truncated"), "{e}");

        // The same state as version 4 wrote it: the exchange's error
        // feedback in int8 blocks, read into this build's int4.
        let mut v4 = shard_head(4, &layout);
        for v in [&shard.master, &shard.m, &shard.v] {
            put_f32s(&mut v4, v);
        }
        for _ in 0..3 {
            // No residuals, no references' forwards.
            v4.extend_from_slice(&0u64.to_le_bytes());
        }
        put_f32s(&mut v4, &[]);
        put_f32s(&mut v4, &outer.anchor);
        put_f32s(&mut v4, &outer.momentum);
        v4.extend_from_slice(&int8_residual(32, &values));
        v4.extend_from_slice(&int8_residual(32, &values[..32]));
        let f = outer.flight.as_ref().unwrap();
        v4.extend_from_slice(&f.due.to_le_bytes());
        put_f32s(&mut v4, &f.then);
        put_f32s(&mut v4, &f.averaged);
        let mut m4 = manifest(4, &layout, (0, 0), 0);
        for info in &mut m4.shards {
            info.outer = Some(vec![OuterLens::of(&outer)]);
        }
        assert_eq!(v4.len(), shard_size(&m4, &m4.shards[1]));
        let old = decode_shard(&v4, "rank-00001.zst", &m4, &m4.shards[1]).unwrap();
        let o = old[0].outer.as_ref().unwrap();
        assert_eq!((&o.anchor, &o.momentum), (&outer.anchor, &outer.momentum));
        assert_eq!(o.flight, outer.flight);
        assert_eq!((o.sent.shape(), o.owned.shape()), ((32, 2), (32, 1)));
        assert_eq!(o.sent.bytes(), Residual::zeros(32, 2).bytes());
        // int8 then int4: within 1/254 + 1/14 of each block's largest (|v| ≤ 1).
        let (sent, owned) = (o.sent.to_f32(), o.owned.to_f32());
        for (b, v) in sent
            .iter()
            .chain(&owned)
            .zip(values.iter().chain(&values[..32]))
        {
            assert!(
                (b - v).abs() <= 1.01 * (1.0 / 254.0 + 1.0 / 14.0),
                "{b} vs {v}"
            );
        }
    }
}
