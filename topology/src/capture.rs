//! `zeropp topo capture`: exactly the files (and symlinks) detection reads,
//! as a tar archive, so a machine can be inspected elsewhere
//! (`tar -xf` it, then `zeropp topo --sysfs-root DIR`).

use std::path::{Component, Path, PathBuf};

/// One entry of a capture, relative to the root.
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    Dir(PathBuf),
    File(PathBuf, Vec<u8>),
    /// A symlink and its target as the link says it (relative).
    Symlink(PathBuf, PathBuf),
}

const PCI_FILES: &[&str] = &[
    "vendor",
    "class",
    "numa_node",
    "current_link_speed",
    "current_link_width",
    "label",
];
const NET_FILES: &[&str] = &["speed", "type", "operstate"];
const IB_PORT_FILES: &[&str] = &["link_layer", "rate", "state"];

struct Collector<'a> {
    root: &'a Path,
    entries: Vec<Entry>,
}

impl Collector<'_> {
    fn rel(&self, p: &Path) -> Option<PathBuf> {
        p.strip_prefix(self.root).ok().map(Path::to_path_buf)
    }

    fn file(&mut self, p: &Path) {
        if let (Ok(bytes), Some(rel)) = (std::fs::read(p), self.rel(p)) {
            self.entries.push(Entry::File(rel, bytes));
        }
    }

    fn files(&mut self, dir: &Path, names: &[&str]) {
        for n in names {
            self.file(&dir.join(n));
        }
    }

    fn dir(&mut self, p: &Path) {
        if let Some(rel) = self.rel(p) {
            self.entries.push(Entry::Dir(rel));
        }
    }

    /// A symlink under `sys/`, and the directory it points to (relative to
    /// the root, with every ancestor's PCI files where they are PCI
    /// functions).
    fn link(&mut self, link: &Path) -> Option<PathBuf> {
        let target = std::fs::read_link(link).ok()?;
        let rel = self.rel(link)?;
        self.entries.push(Entry::Symlink(rel, target.clone()));
        let mut real = link.parent()?.to_path_buf();
        for c in target.components() {
            match c {
                Component::ParentDir => {
                    real.pop();
                }
                Component::Normal(n) => real.push(n),
                _ => return None,
            }
        }
        if !real.starts_with(self.root) {
            return None;
        }
        // Directories from sys/devices down to the target, with the PCI
        // files of each function along the way.
        let sys_devices = self.root.join("sys/devices");
        let mut at = sys_devices.clone();
        self.dir(&at);
        for c in real.strip_prefix(&sys_devices).ok()?.components() {
            at.push(c);
            self.dir(&at);
            let a = at.clone();
            self.files(&a, PCI_FILES);
        }
        Some(real)
    }
}

fn entries_of(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Everything detection reads under `root`, in an order a tar extractor can
/// replay (directories before their contents; duplicates removed).
pub fn capture(root: &Path) -> Vec<Entry> {
    let mut c = Collector {
        root,
        entries: Vec::new(),
    };
    c.file(&root.join("proc/sys/kernel/hostname"));
    for node in entries_of(&root.join("sys/devices/system/node")) {
        c.file(&node.join("cpulist"));
    }
    c.file(&root.join("sys/devices/system/cpu/online"));
    for link in entries_of(&root.join("sys/bus/pci/devices")) {
        c.link(&link);
    }
    for link in entries_of(&root.join("sys/class/net")) {
        if let Some(real) = c.link(&link) {
            c.files(&real, NET_FILES);
            if real.join("bridge").is_dir() {
                c.dir(&real.join("bridge"));
            }
        }
    }
    for link in entries_of(&root.join("sys/class/infiniband")) {
        if let Some(real) = c.link(&link) {
            for port in entries_of(&real.join("ports")) {
                c.dir(&port);
                c.files(&port, IB_PORT_FILES);
            }
        }
    }
    // NVML's facts (names, memory, NVLinks): from the driver when capturing
    // this machine, copied when re-capturing a capture.
    let nvml_file = root.join(crate::nvml::CAPTURE_PATH);
    if nvml_file.is_file() {
        c.file(&nvml_file);
    } else if root == Path::new("/")
        && let Ok(Some(facts)) = crate::nvml::query()
        && let Ok(json) = serde_json::to_vec_pretty(&facts)
    {
        c.entries
            .push(Entry::File(PathBuf::from(crate::nvml::CAPTURE_PATH), json));
    }
    let mut seen = std::collections::HashSet::new();
    let mut out: Vec<Entry> = c
        .entries
        .into_iter()
        .filter(|e| {
            let p = match e {
                Entry::Dir(p) | Entry::File(p, _) | Entry::Symlink(p, _) => p.clone(),
            };
            seen.insert(p)
        })
        .collect();
    // Parents first: every entry's ancestors as directories.
    let mut dirs: Vec<PathBuf> = Vec::new();
    for e in &out {
        let p = match e {
            Entry::Dir(p) | Entry::File(p, _) | Entry::Symlink(p, _) => p,
        };
        let mut a = p.parent();
        while let Some(d) = a.filter(|d| !d.as_os_str().is_empty()) {
            dirs.push(d.to_path_buf());
            a = d.parent();
        }
    }
    dirs.sort();
    dirs.dedup();
    let mut all: Vec<Entry> = dirs
        .into_iter()
        .filter(|d| !out.iter().any(|e| matches!(e, Entry::Dir(p) if p == d)))
        .map(Entry::Dir)
        .collect();
    all.append(&mut out);
    all.sort_by_key(|e| match e {
        Entry::Dir(p) => (p.components().count(), 0, p.clone()),
        Entry::File(p, _) | Entry::Symlink(p, _) => (p.components().count(), 1, p.clone()),
    });
    all
}

/// The entries as a tar archive (GNU headers: long sysfs paths included).
pub fn to_tar(entries: &[Entry]) -> Result<Vec<u8>, crate::TopoError> {
    let mut b = tar::Builder::new(Vec::new());
    let fail = |p: &Path, e: std::io::Error| crate::TopoError::Read {
        path: p.display().to_string(),
        what: format!("cannot archive: {e}"),
    };
    for e in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mtime(0);
        h.set_uid(0);
        h.set_gid(0);
        match e {
            Entry::Dir(p) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                h.set_size(0);
                b.append_data(&mut h, p, std::io::empty())
                    .map_err(|e| fail(p, e))?;
            }
            Entry::Symlink(p, t) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(0o777);
                h.set_size(0);
                b.append_link(&mut h, p, t).map_err(|e| fail(p, e))?;
            }
            Entry::File(p, bytes) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o644);
                h.set_size(bytes.len() as u64);
                b.append_data(&mut h, p, &bytes[..])
                    .map_err(|e| fail(p, e))?;
            }
        }
    }
    b.into_inner().map_err(|e| crate::TopoError::Read {
        path: "the archive".into(),
        what: format!("cannot be finished: {e}"),
    })
}
