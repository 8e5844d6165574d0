//! `zeropp ckpt`: inspect and verify a checkpoint, run its model on text,
//! export it (zeropp's safetensors or a Hugging Face GPT-2).

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use clap::{Subcommand, ValueEnum};

#[derive(Subcommand, Debug)]
pub enum CkptCommand {
    /// Print a checkpoint's manifest and verify every shard (size,
    /// checksum, contents). DIR is a checkpoint or a checkpoint directory
    /// (its latest). Exits non-zero naming the bad file.
    Inspect {
        /// A checkpoint, or a checkpoint directory (its latest).
        dir: PathBuf,
        /// Print the manifest as JSON instead.
        #[arg(long)]
        json: bool,
    },
    /// Write the checkpoint's full model (fp32).
    ///
    /// --format zeropp (the default): one safetensors file OUT, tensors named
    /// like blocks.0.attn.qkv.weight ([in, out] layout). --format hf: a
    /// directory OUT that Hugging Face transformers loads as a GPT-2
    /// (GPT2LMHeadModel.from_pretrained(OUT), AutoTokenizer.from_pretrained(OUT):
    /// config.json, model.safetensors, a byte-level tokenizer).
    ///
    /// Example: zeropp ckpt export ckpt/ gpt2-out --format hf
    Export {
        /// A checkpoint, or a checkpoint directory (its latest).
        dir: PathBuf,
        /// The safetensors file to write (--format hf: the directory).
        out: PathBuf,
        #[arg(long, value_enum, default_value_t = ExportFormat::Zeropp)]
        format: ExportFormat,
    },
    /// Run the checkpoint's model on text: the next-byte loss (mean
    /// cross-entropy, each byte predicting the next) and, with --logits,
    /// the logits as a safetensors file (one tensor "logits",
    /// [texts, bytes, vocab]).
    ///
    /// Example: zeropp ckpt eval ckpt/ --text "to be or not" --json
    Eval {
        /// A checkpoint, or a checkpoint directory (its latest).
        dir: PathBuf,
        /// Text to run, as UTF-8 bytes; repeat for a batch (same byte length).
        #[arg(long, required = true)]
        text: Vec<String>,
        /// Write the logits here.
        #[arg(long)]
        logits: Option<PathBuf>,
        /// Print JSON ({"loss", "texts", "bytes"}).
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ExportFormat {
    /// zeropp's own names, one safetensors file.
    Zeropp,
    /// A Hugging Face GPT-2 directory.
    Hf,
}

/// Refuses an export that would write into the checkpoint it reads (step
/// directory `step`, and the directory of checkpoints holding it, whose
/// `latest` says which is newest): it would replace the checkpoint's own
/// files. A directory export (`files`: the names it writes) is refused
/// where `out` holds anything else, which a loader would read beside it
/// (another model's shards and index).
fn check_export_out(step: &Path, out: &Path, files: Option<&[&str]>) -> Result<()> {
    let real = |p: &Path| -> Option<PathBuf> {
        // The nearest part of `p` that exists, resolved, and the rest.
        let abs = std::path::absolute(p).ok()?;
        let mut head = abs.as_path();
        let mut rest = Vec::new();
        loop {
            if let Ok(r) = head.canonicalize() {
                return Some(rest.iter().rev().fold(r, |acc, part| acc.join(part)));
            }
            rest.push(head.file_name()?.to_owned());
            head = head.parent()?;
        }
    };
    let (Some(out_real), Some(step_real)) = (real(out), real(step)) else {
        return Ok(());
    };
    let root = step_real
        .parent()
        .filter(|p| p.join("latest").is_file())
        .map(Path::to_path_buf);
    for inside in root.iter().chain(std::iter::once(&step_real)) {
        if out_real.starts_with(inside) {
            bail!(
                "{} is inside the checkpoint {}: the export would replace its files; write it \
                 outside (e.g. {})",
                out.display(),
                inside.display(),
                inside
                    .parent()
                    .unwrap_or(Path::new("."))
                    .join(out.file_name().unwrap_or("export".as_ref()))
                    .display()
            );
        }
    }
    if let (Some(files), Ok(entries)) = (files, std::fs::read_dir(out)) {
        let mut others: Vec<String> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !files.contains(&n.as_str()))
            .collect();
        if !others.is_empty() {
            others.sort();
            bail!(
                "{} already holds other files ({}): a loader would read them beside the export \
                 (another model's shards or index); export to a new or empty directory",
                out.display(),
                others.join(", ")
            );
        }
    }
    Ok(())
}

/// Runs `zeropp ckpt`.
pub fn run(command: CkptCommand) -> Result<()> {
    match command {
        CkptCommand::Inspect { dir, json } => {
            let dir = crate::train::checkpoint::resolve(&dir)?;
            let m = crate::train::checkpoint::read_manifest(&dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&m)?);
            } else {
                print!("{}", crate::train::checkpoint::describe(&dir, &m));
            }
            crate::train::checkpoint::verify(&dir, &m)?;
            if !json {
                println!("all {} shards verified", m.shards.len());
            }
        }
        CkptCommand::Export {
            dir,
            out,
            format: ExportFormat::Zeropp,
        } => {
            let dir = crate::train::checkpoint::resolve(&dir)?;
            check_export_out(&dir, &out, None)?;
            let m = crate::train::checkpoint::read_manifest(&dir)?;
            let n = crate::train::checkpoint::export(&dir, &m, &out)?;
            println!("wrote {n} tensors of step {} to {}", m.step, out.display());
        }
        CkptCommand::Export {
            dir,
            out,
            format: ExportFormat::Hf,
        } => {
            let resolved = crate::train::checkpoint::resolve(&dir)?;
            check_export_out(&resolved, &out, Some(crate::train::hf::FILES))?;
            let (n, step) = crate::train::hf::export_dir(&dir, &out)?;
            println!(
                "wrote a GPT-2 of {n} tensors (step {step}) to {}: \
                 transformers.GPT2LMHeadModel.from_pretrained({:?})",
                out.display(),
                out.display().to_string()
            );
        }
        CkptCommand::Eval {
            dir,
            text,
            logits,
            json,
        } => {
            let model = crate::train::infer::Model::load(&dir)?;
            let batch = crate::train::infer::byte_ids(&text);
            let (loss, out) = model.loss(&batch)?;
            if let Some(p) = &logits {
                crate::train::infer::write_logits(p, &out)?;
            }
            if json {
                let j = serde_json::json!({
                    "loss": loss, "texts": batch.len(), "bytes": batch[0].len()
                });
                println!("{j}");
            } else {
                println!(
                    "loss {loss:.4} (next-byte cross-entropy over {} text(s) of {} bytes)",
                    batch.len(),
                    batch[0].len()
                );
            }
        }
    }
    Ok(())
}
