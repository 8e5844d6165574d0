//! Checkpoints as a user relies on them, with real `zeropp train` jobs of
//! 2 logical nodes x 2 ranks: bit-identical resume, resume on another world
//! size, corrupt and mismatched checkpoints named, a failed save (full
//! disk) leaving the previous checkpoint intact, and a rank killed mid-run.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const MODEL: &[&str] = &[
    "--width",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--context",
    "32",
    "--batch",
    "4",
    "--log-every",
    "10",
];

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("zeropp-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn zeropp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_zeropp"))
}

fn show(o: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn train(args: &[&str]) -> Output {
    zeropp()
        .arg("train")
        .args(MODEL)
        .args(["--timeout", "60"])
        .args(args)
        .output()
        .unwrap()
}

fn train_ok(args: &[&str]) -> String {
    let o = train(args);
    assert!(o.status.success(), "{}", show(&o));
    show(&o)
}

fn losses(path: &Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        // The header line says what ran; every other line is a step.
        .filter(|v| v.get("header").is_none())
        .map(|v| v["loss"].as_f64().unwrap())
        .collect()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn resuming_continues_bit_identically_and_on_other_world_sizes() {
    let d = tmp("resume");
    let (full, a, b) = (d.join("full.jsonl"), d.join("a.jsonl"), d.join("b.jsonl"));
    let ck = d.join("ck");
    // 40 steps in one go, and the same 40 steps stopped at 20 and resumed.
    train_ok(&["--steps", "40", "--metrics", s(&full)]);
    let out = train_ok(&[
        "--steps",
        "40",
        "--stop-after",
        "20",
        "--checkpoint-dir",
        s(&ck),
        "--metrics",
        s(&a),
    ]);
    assert!(out.contains("saved checkpoint"), "{out}");
    assert_eq!(
        std::fs::read_to_string(ck.join("latest")).unwrap(),
        "step-00000020"
    );
    // The manifest records the switches the engine ran with, resolved (a
    // JSON object: hpZ over the node of 2 ranks, bf16 inside the node).
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(ck.join("step-00000020").join("manifest.json")).unwrap(),
    )
    .unwrap();
    let sw = &manifest["switches"];
    assert_eq!(
        (sw["hpz_group"].as_u64(), sw["qgz_intra_bits"].as_u64()),
        (Some(2), Some(16)),
        "{manifest}"
    );
    // Each shard keeps its part of the qwZ references (weight differences
    // are the default across nodes): the resume below goes on from them.
    assert_eq!(sw["qwz_delta"], true, "{manifest}");
    for shard in manifest["shards"].as_array().unwrap() {
        let lens = shard["reference_lens"].as_array().unwrap();
        assert!(
            !lens.is_empty() && lens.iter().all(|l| l.as_u64() > Some(0)),
            "{shard}"
        );
    }
    let out = zeropp()
        .args(["train", "--resume", s(&ck), "--metrics", s(&b)])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    assert!(show(&out).contains("resumed from"), "{}", show(&out));
    let (full, a, b) = (losses(&full), losses(&a), losses(&b));
    assert_eq!((a.len(), b.len()), (20, 20));
    assert_eq!(full, [a, b].concat(), "losses differ after resuming");

    // Saved on 4 ranks, resumed on 2 and on 6: the shards are re-cut and
    // training continues from the same model (not bit-identical: the
    // batches depend on the world size).
    let at20 = ck.join("step-00000020");
    for (nodes, g) in [("1", "2"), ("3", "2")] {
        let m = d.join(format!("w{nodes}.jsonl"));
        let out = zeropp()
            .args(["train", "--resume", s(&at20), "--nodes", nodes])
            .args(["--ranks-per-node", g, "--metrics", s(&m)])
            .args(["--checkpoint-dir", s(&d.join(format!("ck{nodes}")))])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", show(&out));
        let l = losses(&m);
        assert_eq!(l.len(), 20);
        // Step 21 of the uninterrupted run was 4.13; a fresh model is at 5.5.
        assert!(
            (l[0] - full[20]).abs() < 0.1 * full[20],
            "first loss after re-cut {} vs {}",
            l[0],
            full[20]
        );
        assert!(l[19] < l[0], "{l:?}");
    }
    std::fs::remove_dir_all(d).ok();
}

/// A resume goes on beside the checkpoint it came from, whatever the
/// directory it runs in: its saves land next to that checkpoint (a copy's
/// resume never writes into the original), the data path the first run
/// gave relative to its own directory still reads, and the run's metrics
/// file gains the resumed steps instead of losing the first ones.
#[test]
fn a_resume_saves_beside_its_checkpoint_and_appends_to_the_metrics() {
    let d = tmp("beside");
    std::fs::write(d.join("data.txt"), "a user's own text, ".repeat(2000)).unwrap();
    let run = |cwd: &Path, args: &[&str]| {
        let o = zeropp()
            .current_dir(cwd)
            .arg("train")
            .args(MODEL)
            .args(["--timeout", "60"])
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", show(&o));
        show(&o)
    };
    let first = [
        "--steps",
        "12",
        "--stop-after",
        "6",
        "--save-every",
        "3",
        "--data",
        "data.txt",
    ];
    run(
        &d,
        &[
            &first[..],
            &["--checkpoint-dir", "ck", "--metrics", "m.jsonl"],
        ]
        .concat(),
    );
    let status = Command::new("cp")
        .args(["-r", s(&d.join("ck")), s(&d.join("copy"))])
        .status()
        .unwrap();
    assert!(status.success());
    let elsewhere = d.join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let out = run(&elsewhere, &["--resume", "../copy", "--stop-after", "9"]);
    assert!(
        out.contains("saved checkpoint ../copy/step-00000009"),
        "{out}"
    );
    let latest = |dir: &str| std::fs::read_to_string(d.join(dir).join("latest")).unwrap();
    assert_eq!(
        (latest("ck"), latest("copy")),
        ("step-00000006".into(), "step-00000009".into())
    );
    assert!(!d.join("ck").join("step-00000009").exists());
    // Resumed where the metrics were written: 6 steps, then 6 more.
    run(&d, &["--resume", "ck"]);
    let text = std::fs::read_to_string(d.join("m.jsonl")).unwrap();
    assert_eq!(text.matches("\"header\"").count(), 2, "{text}");
    assert_eq!(losses(&d.join("m.jsonl")).len(), 12, "{text}");
    std::fs::remove_dir_all(d).ok();
}

/// With `--qwz-int8-references` a resume goes on bit for bit: each shard
/// keeps its own part of the references as the receivers hold it
/// (dequantized), and the load rounds it back to the same int8 blocks.
#[test]
fn int8_references_resume_bit_identically() {
    let d = tmp("int8-refs");
    let (_, summary, _, _) = whole_and_resumed_at_6(&d, &["--qwz-int8-references", "true"]);
    assert_eq!(
        summary["switches"]["qwz_int8_references"], true,
        "{summary}"
    );
    assert!(summary["kept_bytes"]["qwz_references"].as_u64() > Some(0));
    std::fs::remove_dir_all(d).ok();
}

/// The steps' lines of a metrics file (the header dropped).
fn steps_of(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("header").is_none())
        .collect()
}

/// A JSON file a run wrote.
fn json(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// Runs `zeropp train ARGS` (14 steps) whole, and again stopped after step
/// 6 into a checkpoint that is then resumed: the resumed steps' losses and
/// the final validation loss are the whole run's, bit for bit. Returns the
/// whole run's output, summary and metrics file, and the checkpoint root.
fn whole_and_resumed_at_6(
    d: &Path,
    args: &[&str],
) -> (String, serde_json::Value, PathBuf, PathBuf) {
    let (full, b) = (d.join("full.jsonl"), d.join("b.jsonl"));
    let (sfull, sb) = (d.join("full.json"), d.join("b.json"));
    let ck = d.join("ck");
    let whole = [
        args,
        &[
            "--steps",
            "14",
            "--metrics",
            s(&full),
            "--summary-json",
            s(&sfull),
        ],
    ];
    let out = train_ok(&whole.concat());
    train_ok(
        &[
            args,
            &[
                "--steps",
                "14",
                "--stop-after",
                "6",
                "--checkpoint-dir",
                s(&ck),
            ],
        ]
        .concat(),
    );
    let resumed = zeropp()
        .args(["train", "--resume", s(&ck), "--metrics", s(&b)])
        .args(["--summary-json", s(&sb)])
        .output()
        .unwrap();
    assert!(resumed.status.success(), "{}", show(&resumed));
    let (whole_l, b_l) = (losses(&full), losses(&b));
    assert_eq!(b_l.len(), 8);
    assert_eq!(
        whole_l[6..],
        b_l[..],
        "{args:?}: losses differ after resuming"
    );
    assert_eq!(json(&sfull)["val_loss"], json(&sb)["val_loss"], "{args:?}");
    (out, json(&sfull), full, ck)
}

#[test]
fn islands_cross_the_link_only_to_sync_and_resume_bit_identically_between_syncs() {
    let d = tmp("islands");
    // Stopped between syncs (step 6) and resumed: the same losses, the
    // same final model.
    let islands = ["--islands", "2", "--sync-every", "4"];
    let (out, summary, full, ck) = whole_and_resumed_at_6(&d, &islands);
    assert!(
        out.contains("islands: 2 of 2 ranks, each sharding over its own; outer sync every 4 steps"),
        "{out}"
    );
    // Two islands of one node: only the syncs (steps 4, 8, 12) cross
    // between nodes.
    let steps = steps_of(&full);
    for (i, st) in steps.iter().enumerate() {
        let across = st["bytes_inter_node"].as_f64().unwrap();
        assert_eq!(across > 0.0, (i + 1) % 4 == 0, "step {}: {st}", i + 1);
    }
    // Nothing inside an island of one node crosses a node: plain
    // collectives there, and no probe of the link at join.
    assert_eq!(summary["switches"]["qgz"], false, "{summary}");
    assert_eq!(summary["switches"]["qwz_bits"], serde_json::Value::Null);
    assert_eq!(
        summary["why"]["qgz"], "plain: one node, no hop across nodes",
        "{summary}"
    );
    let isl = &summary["islands"];
    // 3 syncs on the way and one at the end (14 is not a multiple of 4).
    assert_eq!(isl["exchanges"], 4, "{summary}");
    assert_eq!(isl["ranks_per_island"], 2, "{summary}");
    assert!(isl["outer_bytes"].as_f64() > Some(0.0), "{summary}");
    // The anchor and momentum of its shard at least, in f32.
    assert!(
        summary["kept_bytes"]["outer_state"].as_u64() > Some(0),
        "{summary}"
    );
    // The same seed trains the same model again.
    let sa = d.join("a.json");
    train_ok(&[&islands[..], &["--steps", "14", "--summary-json", s(&sa)]].concat());
    assert_eq!(json(&sa)["val_loss"], summary["val_loss"]);
    // A checkpoint of islands resumed as one job: re-cut from the first
    // island's weights, and training goes on from them.
    let one = d.join("one.jsonl");
    let out = zeropp()
        .args([
            "train",
            "--resume",
            s(&ck.join("step-00000006")),
            "--islands",
            "1",
        ])
        .args(["--metrics", s(&one)])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let (one, full) = (losses(&one), losses(&full));
    assert!(
        (one[0] - full[6]).abs() < 0.1 * full[6],
        "{} vs {}",
        one[0],
        full[6]
    );
    std::fs::remove_dir_all(d).ok();
}

#[test]
fn streamed_islands_resume_bit_identically_with_an_exchange_under_way() {
    // 2 fragments staggered by 2 steps, each landing 2 steps after it
    // starts: stopped after step 6, fragment 1's exchange (started at 6,
    // due at 8) is in the checkpoint, and the resumed run lands it.
    let d = tmp("streamed");
    let islands = [
        "--islands",
        "2",
        "--sync-every",
        "4",
        "--outer-fragments",
        "2",
        "--outer-delay",
        "2",
    ];
    let (out, _, _, ck) = whole_and_resumed_at_6(&d, &islands);
    assert!(out.contains("2 fragments"), "{out}");
    let manifest = json(&ck.join("step-00000006").join("manifest.json"));
    let in_flight = manifest["shards"][0]["outer"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["flight"] == true)
        .count();
    assert!(
        in_flight > 0,
        "no exchange under way in the checkpoint: {manifest}"
    );
    std::fs::remove_dir_all(d).ok();
}

fn inspect(dir: &Path) -> Output {
    zeropp().args(["ckpt", "inspect", s(dir)]).output().unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn damaged_or_mismatched_checkpoints_are_named_errors() {
    let d = tmp("damage");
    let ck = d.join("ck");
    train_ok(&["--steps", "10", "--checkpoint-dir", s(&ck)]);
    let good = ck.join("step-00000010");
    let o = inspect(&ck);
    assert!(o.status.success(), "{}", show(&o));
    assert!(show(&o).contains("all 4 shards verified"), "{}", show(&o));

    // Export: the full model, every tensor named.
    let st = d.join("model.safetensors");
    let mut export = zeropp();
    export.args(["ckpt", "export", s(&ck), s(&st)]);
    // SAFETY: umask is async-signal-safe.
    unsafe {
        use std::os::unix::process::CommandExt;
        export.pre_exec(|| {
            libc::umask(0o022);
            Ok(())
        });
    }
    let o = export.output().unwrap();
    assert!(o.status.success(), "{}", show(&o));
    // Readable by the others, as a new file is under the usual umask (a
    // shared cluster's users load it), not owner-only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&st).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o644, "mode {mode:o}");
    let bytes = std::fs::read(&st).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    assert_eq!(
        header["blocks.0.attn.qkv.weight"]["shape"],
        serde_json::json!([32, 96])
    );
    assert_eq!(header["embed.tokens"]["dtype"], "F32");

    let case = |name: &str, damage: &dyn Fn(&Path), expect: &[&str]| {
        let c = d.join(name);
        copy_dir(&good, &c);
        damage(&c);
        for o in [inspect(&c), train(&["--steps", "20", "--resume", s(&c)])] {
            let text = show(&o);
            assert!(!o.status.success(), "{name}: accepted\n{text}");
            assert!(!text.contains("panicked"), "{name}: panic\n{text}");
            for e in expect {
                assert!(text.contains(e), "{name}: no {e:?} in\n{text}");
            }
        }
    };
    case(
        "flipped",
        &|c| {
            let p = c.join("rank-00002.zst");
            let mut b = std::fs::read(&p).unwrap();
            let mid = b.len() / 2;
            b[mid] ^= 0x40;
            std::fs::write(&p, b).unwrap();
        },
        &["rank-00002.zst", "checksum"],
    );
    case(
        "truncated",
        &|c| {
            let p = c.join("rank-00001.zst");
            let b = std::fs::read(&p).unwrap();
            std::fs::write(&p, &b[..b.len() - 100]).unwrap();
        },
        &["rank-00001.zst", "truncated"],
    );
    case(
        "missing",
        &|c| std::fs::remove_file(c.join("rank-00003.zst")).unwrap(),
        &["missing shard", "rank-00003.zst"],
    );
    // A shard missing or cut short, or no step left to train, is said once
    // by the self-launched run before any rank starts.
    let c = d.join("missing");
    for (args, said) in [
        (&["--steps", "20"][..], "missing shard"),
        (&["--steps", "3"][..], "raise --steps"),
    ] {
        std::fs::copy(good.join("rank-00003.zst"), c.join("rank-00003.zst")).ok();
        if said == "missing shard" {
            std::fs::remove_file(c.join("rank-00003.zst")).unwrap();
        }
        let o = train(&[args, &["--resume", s(&c)]].concat());
        let text = show(&o);
        assert!(!o.status.success(), "{text}");
        assert_eq!(text.matches(said).count(), 1, "{text}");
        assert!(!text.contains("[rank"), "a rank started:\n{text}");
    }
    let edit = |c: &Path, f: &dyn Fn(&mut serde_json::Value)| {
        let p = c.join("manifest.json");
        let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        f(&mut m);
        std::fs::write(&p, serde_json::to_vec(&m).unwrap()).unwrap();
    };
    case(
        "version",
        &|c| edit(c, &|m| m["version"] = 99.into()),
        &["manifest.json", "version 99"],
    );
    case(
        "garbage-manifest",
        &|c| std::fs::write(c.join("manifest.json"), b"{\"format\": \"zeropp-chec").unwrap(),
        &["manifest.json", "not a zeropp manifest"],
    );
    // A shard that checks out but does not hold what the manifest says.
    case(
        "wrong-units",
        &|c| edit(c, &|m| m["units"][1]["chunk"] = 7.into()),
        &["rank-00000.zst"],
    );

    // Sizes a crafted manifest claims (with its checksums still right)
    // never size an allocation: a named error, not an abort.
    case(
        "crafted-sizes",
        &|c| {
            edit(c, &|m| {
                let units = m["units"].as_array().unwrap().len();
                let huge = serde_json::json!([0u64, 1_000_000_000_000u64]);
                m["shards"][0]["residual_lens"] = vec![huge; units].into();
            })
        },
        &["rank-00000.zst", "the manifest implies"],
    );

    // An export into the checkpoint it reads would replace its files (its
    // manifest, `latest`); one into another model's directory would leave
    // that model's shards beside it: refused, the checkpoint intact.
    let stale = d.join("stale");
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("model-00001-of-00002.safetensors"), b"x").unwrap();
    for (out, format, said) in [
        (
            good.join("manifest.json"),
            "zeropp",
            "is inside the checkpoint",
        ),
        (ck.join("latest"), "zeropp", "is inside the checkpoint"),
        (ck.join("hf"), "hf", "is inside the checkpoint"),
        (stale.clone(), "hf", "model-00001-of-00002.safetensors"),
    ] {
        let o = zeropp()
            .args(["ckpt", "export", s(&ck), s(&out), "--format", format])
            .output()
            .unwrap();
        assert!(
            !o.status.success() && show(&o).contains(said),
            "{}",
            show(&o)
        );
    }
    let o = inspect(&ck);
    assert!(o.status.success(), "{}", show(&o));
    // A new run into it would mix its saves with these and prune them.
    let o = zeropp()
        .args(["train", "--steps", "4", "--checkpoint-dir", s(&ck)])
        .output()
        .unwrap();
    assert!(
        !o.status.success() && show(&o).contains("holds an earlier run's checkpoints"),
        "{}",
        show(&o)
    );
    assert!(
        show(&o).contains(&format!("--resume {}", ck.display())),
        "{}",
        show(&o)
    );

    // A manifest whose units are not its model's: inspect says so, and no
    // export writes tensors under names (or sizes) the model does not have.
    let c = d.join("renamed-unit");
    copy_dir(&good, &c);
    edit(&c, &|m| m["units"][1]["name"] = "blocks.7".into());
    for format in ["zeropp", "hf"] {
        let o = zeropp()
            .args([
                "ckpt",
                "export",
                s(&c),
                s(&d.join(format!("out-{format}"))),
                "--format",
                format,
            ])
            .output()
            .unwrap();
        let text = show(&o);
        assert!(!o.status.success(), "{format}: exported\n{text}");
        assert!(
            text.contains("manifest.json") && text.contains("not those of the model"),
            "{format}: {text}"
        );
    }
    let o = inspect(&c);
    assert!(!o.status.success(), "inspect passed\n{}", show(&o));
    assert!(show(&o).contains("not those of the model"), "{}", show(&o));

    // The right checkpoint with the wrong model shape: named, not loaded.
    let o = zeropp()
        .args([
            "train",
            "--steps",
            "20",
            "--resume",
            s(&good),
            "--width",
            "64",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        show(&o).contains("was trained with width 32 (asked: 64)") && show(&o).contains("--width"),
        "{}",
        show(&o)
    );
    // A latest that names a step gone: the ones there are named.
    let root = d.join("root");
    copy_dir(&good, &root.join("step-00000010"));
    std::fs::write(root.join("latest"), "step-00000012").unwrap();
    let o = inspect(&root);
    assert!(!o.status.success());
    assert!(
        show(&o).contains("checkpoints here: step-00000010 (name one by its path"),
        "{}",
        show(&o)
    );
    // No latest at all: the same.
    std::fs::remove_file(root.join("latest")).unwrap();
    let o = inspect(&root);
    assert!(!o.status.success());
    assert!(
        show(&o).contains("checkpoints here: step-00000010"),
        "{}",
        show(&o)
    );
    // Nothing there at all.
    let o = inspect(&d.join("nothing"));
    assert!(!o.status.success());
    assert!(show(&o).contains("no checkpoint at"), "{}", show(&o));
    std::fs::remove_dir_all(d).ok();
}

#[test]
fn a_save_that_fails_for_lack_of_space_leaves_the_previous_checkpoint_usable() {
    let d = tmp("full");
    let ck = d.join("ck");
    train_ok(&[
        "--steps",
        "20",
        "--stop-after",
        "10",
        "--checkpoint-dir",
        s(&ck),
    ]);
    // Resume with files limited to 32 KiB (a disk that fills up): every
    // shard is larger, so the save at step 20 fails. Over TCP: the limit
    // would also cap UCX's shared-memory segments, which a full disk does not.
    let mut cmd = zeropp();
    cmd.args(["train", "--resume", s(&ck), "--transport", "tcp"]);
    // SAFETY: setrlimit and signal are async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 32 << 10,
                rlim_max: 32 << 10,
            };
            libc::setrlimit(libc::RLIMIT_FSIZE, &lim);
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    let o = cmd.output().unwrap();
    let text = show(&o);
    assert!(!o.status.success(), "{text}");
    assert!(text.contains("previous checkpoint"), "{text}");
    assert!(!text.contains("panicked"), "{text}");
    assert_eq!(
        std::fs::read_to_string(ck.join("latest")).unwrap(),
        "step-00000010"
    );
    assert!(!ck.join("step-00000020").exists());
    let o = inspect(&ck);
    assert!(o.status.success(), "{}", show(&o));
    // And resuming from it still works; its save removes what interrupted
    // saves left, of any step (one of another run's step 99 too).
    let other = ck.join(".tmp-step-00000099");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("rank-00000.zst"), b"partial").unwrap();
    train_ok(&["--resume", s(&ck)]);
    assert_eq!(
        std::fs::read_to_string(ck.join("latest")).unwrap(),
        "step-00000020"
    );
    let left: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(".tmp-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(d).ok();
}

fn children(pid: u32) -> Vec<u32> {
    let path = format!("/proc/{pid}/task/{pid}/children");
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

#[test]
fn a_rank_killed_mid_run_is_named_and_the_last_checkpoint_resumes() {
    let d = tmp("kill");
    let ck = d.join("ck");
    let job = zeropp()
        .arg("train")
        .args(MODEL)
        .args(["--steps", "100000", "--save-every", "5", "--timeout", "20"])
        .args(["--checkpoint-dir", s(&ck)])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !ck.join("latest").exists() {
        assert!(t.elapsed() < Duration::from_secs(120), "no checkpoint");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    let ranks = children(job.id());
    assert_eq!(ranks.len(), 4, "{ranks:?}");
    // The launcher starts ranks in order: this is rank 2.
    unsafe {
        libc::kill(ranks[2] as i32, libc::SIGKILL);
    }
    let t = Instant::now();
    let o = job.wait_with_output().unwrap();
    assert!(t.elapsed() < Duration::from_secs(60));
    let text = show(&o);
    assert!(!o.status.success(), "{text}");
    assert!(text.contains("rank 2"), "{text}");
    assert!(!text.contains("panicked"), "{text}");
    // The last complete checkpoint verifies and resumes.
    let o = inspect(&ck);
    assert!(o.status.success(), "{}", show(&o));
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    let step: usize = latest.trim_start_matches("step-").parse().unwrap();
    let stop = (step + 5).to_string();
    let out = zeropp()
        .args(["train", "--resume", s(&ck), "--stop-after", &stop])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    assert!(
        show(&out).contains(&format!("at step {step}")),
        "{}",
        show(&out)
    );
    std::fs::remove_dir_all(d).ok();
}

#[test]
fn a_killed_island_leaves_the_outer_sync_and_the_others_finish_and_resume_it() {
    // 2 islands of one node x 2 ranks; rank 2 (island 1) is killed after
    // the first checkpoint: island 0 trains on to the last step without
    // it, saves without it, and the run resumes with island 1 restarted
    // from island 0's shards.
    let d = tmp("island-kill");
    let (ck, metrics, summary) = (d.join("ck"), d.join("m.jsonl"), d.join("s.json"));
    let job = zeropp()
        .arg("train")
        .args(MODEL)
        .args(["--islands", "2", "--sync-every", "4", "--transport", "tcp"])
        .args(["--restarts", "0"])
        .args(["--steps", "1000", "--save-every", "20", "--timeout", "20"])
        .args(["--checkpoint-dir", s(&ck), "--metrics", s(&metrics)])
        .args(["--summary-json", s(&summary)])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let text = kill_rank_when(job, (2, 4), || ck.join("latest").exists());
    assert!(
        text.contains("island 1 was lost (rank 2 failed with signal 9)"),
        "{text}"
    );
    assert!(!text.contains("panicked"), "{text}");
    let sm = json(&summary);
    assert_eq!(sm["steps"], 1000, "{sm}");
    let lost = sm["islands"]["lost"].as_array().unwrap();
    assert_eq!(lost.len(), 1, "{sm}");
    assert_eq!(lost[0]["island"], 1, "{sm}");
    let after = lost[0]["after_step"].as_u64().unwrap();
    assert!((20..1000).contains(&after), "{sm}");
    // Named by the rank that saw it: rank 2 itself, or rank 3 (across
    // from rank 1), which ends once rank 2 is gone. The summary is rank
    // 0's: where rank 1 saw it first (a race under load), rank 0 relays
    // it, naming the rank when the job-wide call carried it.
    let why = lost[0]["why"].as_str().unwrap();
    let relayed = why.starts_with("another rank of this island lost it");
    assert!(
        why.contains("rank 2") || why.contains("rank 3") || relayed,
        "{sm}"
    );
    assert!(sm["val_loss"].as_f64().unwrap().is_finite(), "{sm}");
    // Island 0 never stopped for long: every step it logged (the one
    // that found island 1 gone included) took seconds at most.
    let steps = steps_of(&metrics);
    assert_eq!(steps.len(), 1000);
    let slowest = steps
        .iter()
        .map(|st| st["step_time_s"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(slowest < 60.0, "a step took {slowest} s");
    // The last checkpoint holds island 0's shards and says island 1 was
    // lost; it verifies, and resumes with both islands.
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    let m = json(&ck.join(&latest).join("manifest.json"));
    assert_eq!(m["lost_islands"], serde_json::json!([1]), "{m}");
    let o = inspect(&ck);
    assert!(o.status.success(), "{}", show(&o));
    assert!(
        show(&o).contains("islands lost before the save: [1]"),
        "{}",
        show(&o)
    );
    let resumed = d.join("r.json");
    let out = train_ok(&[
        "--islands",
        "2",
        "--sync-every",
        "4",
        "--steps",
        "1008",
        "--resume",
        s(&ck),
        "--summary-json",
        s(&resumed),
    ]);
    assert!(out.contains("at step 1000"), "{out}");
    let r = json(&resumed);
    assert_eq!(r["islands"]["lost"], serde_json::json!([]), "{r}");
    assert_eq!(r["islands"]["exchanges"], 2, "{r}");
    std::fs::remove_dir_all(d).ok();
}

#[test]
fn a_killed_island_is_restarted_and_rejoins_from_a_live_island() {
    // As above, with the launcher restarting the lost island's ranks —
    // island 0, rank 0's own, whose store is the launcher's: they fetch
    // the state of island 1's ranks at their next outer sync and train on
    // with them to the end; the restarted rank 0 writes on where the run
    // was (metrics and summary).
    let d = tmp("island-rejoin");
    let (metrics, summary) = (d.join("m.jsonl"), d.join("s.json"));
    let job = zeropp()
        .arg("train")
        .args(MODEL)
        .args(["--islands", "2", "--sync-every", "4", "--restarts", "1"])
        .args(["--steps", "2000", "--timeout", "20"])
        .args(["--metrics", s(&metrics), "--summary-json", s(&summary)])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let text = kill_rank_when(job, (0, 4), || steps_logged(&metrics) >= 50);
    assert!(text.contains("restarting the ranks of island 0"), "{text}");
    for r in [0, 1] {
        assert!(
            text.contains(&format!("rank {r}: rejoined after step")),
            "{text}"
        );
    }
    let sm = json(&summary);
    assert_eq!(sm["steps"], 2000, "{sm}");
    // The rejoined rank 0 learnt the run's past from the state it was sent.
    let (lost, back) = (&sm["islands"]["lost"], &sm["islands"]["rejoined"]);
    assert_eq!(lost[0]["island"], 0, "{sm}");
    assert_eq!(back[0]["island"], 0, "{sm}");
    let (left, came) = (
        lost[0]["after_step"].as_u64().unwrap(),
        back[0]["after_step"].as_u64().unwrap(),
    );
    assert!(left < came && came < 2000, "{sm}");
    // It rejoined at an outer sync.
    assert_eq!(came % 4, 0, "{sm}");
    assert!(sm["val_loss"].as_f64().unwrap().is_finite(), "{sm}");
    // The metrics: rank 0's steps up to the kill, then the restarted rank
    // 0's from the step it rejoined after, under a second header.
    let steps: Vec<u64> = steps_of(&metrics)
        .iter()
        .map(|st| st["step"].as_u64().unwrap())
        .collect();
    let cut = steps.iter().position(|&n| n == came + 1).unwrap();
    assert!(cut >= 50 && steps[..cut] == (1..=cut as u64).collect::<Vec<_>>());
    assert_eq!(steps[cut..], (came + 1..=2000).collect::<Vec<_>>());
    let headers = std::fs::read_to_string(&metrics).unwrap();
    let starts: Vec<u64> = headers
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["header"]["start_step"].as_u64())
        .collect();
    assert_eq!(starts, [0, came]);
    // After the rejoin the syncs cross between the islands again.
    let after = &steps_of(&metrics)[cut + 3];
    assert!(after["bytes_inter_node"].as_f64().unwrap() > 0.0, "{after}");
    std::fs::remove_dir_all(d).ok();
}

#[test]
fn an_island_dead_as_the_job_starts_is_restarted_and_trains_with_the_others_from_the_start() {
    // A rank's first start dies before it joins (a node failing as the job
    // starts: SIGKILLed at once). No island met it, so nobody has trained:
    // its restarted self starts with the others from step 0, as if the
    // first start had not failed, instead of waiting to rejoin a job that
    // never ran. Island 0 (rank 0, lowest of all) and island 1.
    for victim in ["0", "1"] {
        let d = tmp(&format!("island-dies-at-start-{victim}"));
        let summary = d.join("s.json");
        let o = zeropp()
            .args(["launch", "--nodes", "2", "--ranks-per-node", "1"])
            .args(["--islands", "2", "--restarts", "1", "--timeout", "60", "--"])
            .args(["sh", "-c"])
            .arg(r#"[ -z "$ZEROPP_REJOIN" ] && [ "$RANK" = "$VICTIM" ] && kill -9 $$; exec "$@""#)
            .args(["sh", env!("CARGO_BIN_EXE_zeropp"), "train"])
            .args(MODEL)
            .args(["--islands", "2", "--sync-every", "5", "--steps", "400"])
            .args(["--summary-json", s(&summary)])
            .env("VICTIM", victim)
            .env_remove("ZEROPP_TRANSPORT")
            .output()
            .unwrap();
        let text = show(&o);
        assert!(o.status.success(), "{text}");
        assert!(
            text.contains(&format!("rank {victim} failed with signal 9")),
            "{text}"
        );
        assert!(
            text.contains(&format!("rank {victim}: restarted before the islands met")),
            "{text}"
        );
        assert!(!text.contains("rejoined after step"), "{text}");
        // No transport asked: the ranks chose TCP, which takes restarted
        // ranks back, and said why.
        assert!(text.contains("only TCP takes its ranks back"), "{text}");
        let sm = json(&summary);
        assert_eq!(sm["steps"], 400, "{sm}");
        // Both islands trained every step together: nothing lost, nothing
        // rejoined, every sync exchanged (rank 0 ran all 400 steps).
        assert_eq!(sm["islands"]["lost"], serde_json::json!([]), "{sm}");
        assert_eq!(sm["islands"]["rejoined"], serde_json::json!([]), "{sm}");
        assert_eq!(sm["islands"]["exchanges"], 80, "{sm}");
        std::fs::remove_dir_all(d).ok();
    }
}

#[test]
fn of_three_islands_a_killed_one_is_lost_and_the_two_others_keep_each_other() {
    // 3 islands of one rank, syncing every 2 steps, so the kill likely
    // lands in an exchange: the island whose ring predecessor gives the
    // exchange up (its own predecessor, island 2, dead) hears why and takes
    // island 2 out too, rather than wait --timeout and take island 0 out.
    // A kill that lands after island 2 answered one survivor's exchange
    // but not the other's leaves them at two exchanges: the one that
    // completed it hands its result over, and both go on together.
    let d = tmp("island3-kill");
    let (metrics, summary) = (d.join("m.jsonl"), d.join("s.json"));
    let job = zeropp()
        .arg("train")
        .args(MODEL)
        .args(["--nodes", "3", "--ranks-per-node", "1"])
        .args(["--islands", "3", "--sync-every", "2", "--transport", "tcp"])
        .args(["--restarts", "0", "--steps", "600", "--timeout", "20"])
        .args(["--metrics", s(&metrics), "--summary-json", s(&summary)])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let text = kill_rank_when(job, (2, 3), || steps_logged(&metrics) >= 30);
    let sm = json(&summary);
    assert_eq!(sm["steps"], 600, "{sm}");
    let lost: Vec<u64> = sm["islands"]["lost"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["island"].as_u64().unwrap())
        .collect();
    assert_eq!(lost, [2], "{sm}\n{text}");
    // Islands 0 and 1 still averaged their syncs: bytes crossed after the
    // loss.
    let steps = steps_of(&metrics);
    let last = &steps[steps.len() - 4..];
    let crossed = |st: &serde_json::Value| st["bytes_inter_node"].as_f64().unwrap() > 0.0;
    assert!(last.iter().any(crossed), "{last:?}");
    std::fs::remove_dir_all(d).ok();
}

/// Once `ready`, SIGKILLs rank `rank` of `job` (its `ranks` in all,
/// started by the launcher in order) and waits for the job, which must
/// succeed (the other islands go on); its output.
fn kill_rank_when(
    job: std::process::Child,
    (rank, ranks): (usize, usize),
    ready: impl Fn() -> bool,
) -> String {
    let t = Instant::now();
    while !ready() {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the job never got there"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let count = ranks;
    let ranks = children(job.id());
    assert_eq!(ranks.len(), count, "{ranks:?}");
    // The launcher starts ranks in order.
    unsafe {
        libc::kill(ranks[rank] as i32, libc::SIGKILL);
    }
    let o = job.wait_with_output().unwrap();
    let text = show(&o);
    assert!(o.status.success(), "{text}");
    text
}

/// Steps in a metrics file so far (0 before it exists).
fn steps_logged(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .map(|t| t.lines().filter(|l| l.contains("\"step\"")).count())
        .unwrap_or(0)
}

#[test]
fn an_automatic_h_is_chosen_at_the_first_sync_and_a_resume_keeps_it() {
    // --sync-every auto: the first sync after 10 steps measures an
    // exchange against the inner steps; the islands agree on one H from
    // there, the summary says which and why, and a checkpoint saved after
    // the choice resumes on the same schedule (bit-identical losses).
    let d = tmp("auto-h");
    let (full, b, sfull) = (d.join("full.jsonl"), d.join("b.jsonl"), d.join("full.json"));
    let ck = d.join("ck");
    let out = train_ok(&[
        "--islands",
        "2",
        "--sync-every",
        "auto",
        "--steps",
        "30",
        "--save-every",
        "12",
        "--checkpoint-dir",
        s(&ck),
        "--metrics",
        s(&full),
        "--summary-json",
        s(&sfull),
    ]);
    assert!(
        out.contains("outer sync every 10 steps, then the H measured there (auto)"),
        "{out}"
    );
    let sm = json(&sfull);
    let chosen = &sm["islands"]["sync_every_chosen"];
    assert_eq!(chosen["from_step"], 10, "{sm}");
    let h = chosen["sync_every"].as_u64().unwrap() as usize;
    assert!(h >= 1, "{sm}");
    assert_eq!(sm["islands"]["sync_every"], h, "{sm}");
    assert!(
        chosen["why"].as_str().unwrap().contains("inner step"),
        "{sm}"
    );
    // Syncs crossed between the islands at step 10 and every H after.
    let steps = steps_of(&full);
    for (i, st) in steps.iter().enumerate() {
        let step = i + 1;
        // (The last sync, at the end of the run, comes after the last
        // step's metrics.)
        let synced = step == 10 || (step > 10 && (step - 10) % h == 0);
        let across = st["bytes_inter_node"].as_f64().unwrap();
        assert_eq!(across > 0.0, synced, "step {step} (H = {h}): {st}");
    }
    let m = json(&ck.join("step-00000012").join("manifest.json"));
    assert_eq!(m["islands_schedule"]["sync_every"], h, "{m}");
    assert_eq!(m["islands_schedule"]["origin"], 10, "{m}");
    let resumed = zeropp()
        .args(["train", "--resume"])
        .arg(ck.join("step-00000012"))
        .args(["--metrics", s(&b)])
        .output()
        .unwrap();
    assert!(resumed.status.success(), "{}", show(&resumed));
    assert_eq!(
        losses(&full)[12..],
        losses(&b)[..],
        "losses differ after resuming"
    );
    // A word that is neither a number nor auto is refused.
    let o = train(&["--islands", "2", "--sync-every", "often"]);
    assert!(!o.status.success());
    assert!(show(&o).contains("a number, or auto"), "{}", show(&o));
    std::fs::remove_dir_all(d).ok();
}
