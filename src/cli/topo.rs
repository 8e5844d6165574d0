//! `zeropp topo`: what this machine (or a captured one) is made of, a
//! capture of exactly what detection reads, and the routing plan for N
//! nodes like it.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;

/// `zeropp topo`'s arguments.
#[derive(clap::Args, Debug)]
pub struct TopoArgs {
    #[command(subcommand)]
    pub action: Option<TopoAction>,
    /// Read this captured root (holding sys/ and proc/) instead of /.
    #[arg(long, global = true)]
    pub sysfs_root: Option<PathBuf>,
    /// Parse the text of `nvidia-smi topo -m` instead.
    #[arg(long, global = true, conflicts_with = "sysfs_root")]
    pub nvidia_smi_topo: Option<PathBuf>,
    /// Read an NCCL topology dump (NCCL_TOPO_DUMP_FILE) instead.
    #[arg(long, global = true, conflicts_with_all = ["sysfs_root", "nvidia_smi_topo"])]
    pub nccl_xml: Option<PathBuf>,
    /// Print JSON instead of the human view.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum TopoAction {
    /// Write exactly the files detection reads to OUT.tar.zst (attach it
    /// to a bug report; unpack with `tar --zstd -xf OUT.tar.zst -C DIR` and
    /// read it with `zeropp topo --sysfs-root DIR`).
    Capture { out: PathBuf },
    /// The routing plan for N nodes like this one, G ranks each: hop
    /// classes with estimated bandwidth, hpZ group, qgZ bits per hop, each
    /// rank's NIC and the NCCL/UCX environment, with the reason for each.
    Plan {
        #[arg(long)]
        nodes: usize,
        #[arg(long)]
        ranks_per_node: usize,
    },
}

/// Runs `zeropp topo`.
pub fn run(args: TopoArgs) -> Result<()> {
    match args {
        TopoArgs {
            action: Some(TopoAction::Capture { out }),
            sysfs_root,
            ..
        } => {
            let root = sysfs_root.unwrap_or_else(|| PathBuf::from("/"));
            zeropp_topology::detect::detect(&root)?;
            let entries = zeropp_topology::capture::capture(&root);
            let tar = zeropp_topology::capture::to_tar(&entries).map_err(anyhow::Error::msg)?;
            let packed = zstd::encode_all(&tar[..], 19).context("compressing the capture")?;
            std::fs::write(&out, &packed)
                .with_context(|| format!("cannot write {}", out.display()))?;
            println!(
                "captured {} entries ({} bytes) to {}",
                entries.len(),
                packed.len(),
                out.display()
            );
        }
        TopoArgs {
            action,
            sysfs_root,
            nvidia_smi_topo,
            nccl_xml,
            json,
        } => {
            let read = |f: &PathBuf| {
                std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))
            };
            let topo = match (nvidia_smi_topo, nccl_xml) {
                (Some(f), _) => zeropp_topology::smi::parse(&read(&f)?).with_context(|| {
                    format!("{} is not `nvidia-smi topo -m` output", f.display())
                })?,
                (_, Some(f)) => {
                    let host = f.file_stem().map(|s| s.to_string_lossy().into_owned());
                    zeropp_topology::nccl::parse(&read(&f)?, host.as_deref().unwrap_or("nccl-xml"))
                        .with_context(|| format!("{} is not an NCCL topology dump", f.display()))?
                }
                (None, None) => zeropp_topology::detect::detect(
                    sysfs_root.as_deref().unwrap_or(std::path::Path::new("/")),
                )?,
            };
            match action {
                Some(TopoAction::Plan {
                    nodes,
                    ranks_per_node,
                }) => {
                    let plan = zeropp_topology::plan::plan(&topo, nodes, ranks_per_node)
                        .map_err(anyhow::Error::msg)?;
                    if json {
                        println!("{}", serde_json::to_string_pretty(&plan)?);
                    } else {
                        print!("{}", plan.render());
                    }
                }
                _ if json => println!("{}", serde_json::to_string_pretty(&topo)?),
                _ => print!("{}", topo.render()),
            }
        }
    }
    Ok(())
}
