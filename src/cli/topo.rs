//! `zeropp topo`: what this machine (or a captured one) is made of, a
//! capture of exactly what detection reads, and the routing plan for N
//! nodes like it.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
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
        /// Nodes like this one in the job (N).
        #[arg(long)]
        nodes: usize,
        /// Ranks (GPUs) per node (G).
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
            let tar = zeropp_topology::capture::to_tar(&entries)?;
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
            // A topology dump is a few KB: read at most 16 MB of one (a
            // device or a wrong file named is refused, not read whole).
            let read = |f: &PathBuf| -> Result<String> {
                use std::io::Read;
                const MOST: u64 = 16 << 20;
                let file = std::fs::File::open(f)
                    .with_context(|| format!("cannot read {}", f.display()))?;
                let mut text = String::new();
                file.take(MOST + 1)
                    .read_to_string(&mut text)
                    .with_context(|| format!("cannot read {} (text)", f.display()))?;
                if text.len() as u64 > MOST {
                    bail!("{}: over 16 MB, not a topology dump", f.display());
                }
                Ok(text)
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
                    // The plan lists every local rank; a node of more ranks
                    // than any machine has is a mistake, not a plan.
                    const MOST: usize = 1 << 16;
                    if nodes > MOST || ranks_per_node > 1024 {
                        bail!(
                            "--nodes {nodes} --ranks-per-node {ranks_per_node}: at most {MOST} \
                             nodes of at most 1024 ranks (`zeropp plan` predicts larger jobs)"
                        );
                    }
                    let plan = zeropp_zero::routing::plan(&topo, nodes, ranks_per_node)
                        .map_err(anyhow::Error::msg)?;
                    let run = crate::zero::plan::before_measuring(&topo, nodes, ranks_per_node)
                        .map_err(|e| anyhow::anyhow!("resolving a run's switches: {e}"))?;
                    if json {
                        let mut v = serde_json::to_value(&plan)?;
                        v["run_switches"] = serde_json::to_value(&run)?;
                        println!("{}", serde_json::to_string_pretty(&v)?);
                    } else {
                        print!("{}", plan.render());
                        print!("{}", render_run_switches(&run));
                    }
                }
                _ if json => println!("{}", serde_json::to_string_pretty(&topo)?),
                _ => print!("{}", topo.render()),
            }
        }
    }
    Ok(())
}

/// The switches a run would use, with why where the plan chose them.
fn render_run_switches(r: &crate::zero::plan::Resolved) -> String {
    let s = &r.switches;
    let mut out = String::from(
        "switches of `zeropp train` here (mode zeropp, before the links a run measures at join, \
         which may change them; the run prints its own):\n",
    );
    let weights = match (s.qwz_bits, s.qwz_delta) {
        (Some(b), true) => format!("int{b} weight differences across nodes"),
        (Some(b), false) => format!("int{b} weights across nodes"),
        (None, _) => "weights unquantized".into(),
    };
    out += &format!("  qwZ: {weights}\n");
    let hpz = match (s.hpz, s.hpz_group) {
        (true, Some(h)) => format!(
            "secondary shards over groups of {}",
            crate::comm::count(h, "rank")
        ),
        (true, None) => "secondary shards over the node".into(),
        (false, _) => "off".into(),
    };
    out += &format!("  hpZ: {hpz}\n");
    let qgz = match s.qgz {
        true if s.qgz_intra_bits == 16 => "bf16 inside the node, int4 across".into(),
        true => format!("int{} inside the node, int4 across", s.qgz_intra_bits),
        false => "off (plain ring)".into(),
    };
    out += &format!("  qgZ: {qgz}\n");
    for (name, why) in &r.why {
        out += &format!("  {name}: {why}\n");
    }
    out
}
