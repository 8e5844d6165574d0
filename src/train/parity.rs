//! `zeropp train --compare --seeds A..B`: loss parity measured against its
//! noise floor. For every seed, three runs of the same model and data:
//! ZeRO-3, ZeRO-3 with fp32 instead of bf16 communication (a perturbation
//! too small to matter: how far a run moves when only the last bits of its
//! sums change), and ZeRO++. Each ZeRO++ run lands off ZeRO-3's by chance
//! (training is chaotic: any perturbation moves a run); parity is a mean gap
//! over the seeds that chance explains — inside two standard errors of the
//! per-seed gaps and of the noise floor — and within the targets.

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::train::config::{Mode, TrainConfig};
use crate::train::local::run_mode;

/// The seeds of `--seeds`.
#[derive(Clone, Debug, PartialEq)]
pub struct Seeds(pub Vec<u64>);

/// `--seeds`: `A..B` (B excluded), `A..=B`, or a list `1,5,9`.
pub fn parse_seeds(s: &str) -> Result<Seeds, String> {
    let num = |t: &str| {
        t.trim()
            .parse::<u64>()
            .map_err(|_| format!("{t:?} is not a seed (a non-negative integer)"))
    };
    // Each seed is three training runs: a range is counted before it is
    // made.
    const MOST: u64 = 1000;
    let range = |a: u64, end: u64| {
        if end.saturating_sub(a) > MOST {
            return Err(format!(
                "--seeds {s:?} names {} seeds, three runs each; at most {MOST}",
                end.saturating_sub(a)
            ));
        }
        Ok((a..end).collect::<Vec<u64>>())
    };
    let seeds: Vec<u64> = if let Some((a, b)) = s.split_once("..=") {
        range(num(a)?, num(b)?.saturating_add(1))?
    } else if let Some((a, b)) = s.split_once("..") {
        range(num(a)?, num(b)?)?
    } else {
        s.split(',').map(num).collect::<Result<_, _>>()?
    };
    let mut distinct = seeds.clone();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() != seeds.len() {
        return Err(format!(
            "--seeds {s:?} names a seed twice: a repeated seed is the same run, not another sample"
        ));
    }
    if seeds.len() < 2 {
        return Err(format!(
            "--seeds {s:?} names {} seed(s); a spread needs at least 2 (5 or more to judge parity)",
            seeds.len()
        ));
    }
    Ok(Seeds(seeds))
}

/// One seed's three runs.
#[derive(Clone, Debug, Serialize)]
pub struct SeedRow {
    pub seed: u64,
    pub zero3_final: f32,
    pub zero3_val: f32,
    pub zero3_fp32_final: f32,
    pub zero3_fp32_val: f32,
    pub zeropp_final: f32,
    pub zeropp_val: f32,
}

impl SeedRow {
    /// ZeRO++'s final-loss and validation gaps to ZeRO-3, relative.
    pub fn gap(&self) -> (f64, f64) {
        (
            rel(self.zeropp_final, self.zero3_final),
            rel(self.zeropp_val, self.zero3_val),
        )
    }
    /// The perturbation's gaps (fp32 against bf16 ZeRO-3), relative.
    pub fn noise(&self) -> (f64, f64) {
        (
            rel(self.zero3_fp32_final, self.zero3_final),
            rel(self.zero3_fp32_val, self.zero3_val),
        )
    }
}

fn rel(a: f32, b: f32) -> f64 {
    (a as f64 - b as f64) / b as f64
}

/// Mean, sample standard deviation and largest magnitude.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct Spread {
    pub mean: f64,
    pub std: f64,
    pub max_abs: f64,
}

impl Spread {
    pub fn of(v: &[f64]) -> Spread {
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
        Spread {
            mean,
            std: var.sqrt(),
            max_abs: v.iter().fold(0.0, |m, x| m.max(x.abs())),
        }
    }
}

/// What `--seeds` reports (and writes with `--summary-json`).
#[derive(Clone, Debug, Serialize)]
pub struct Parity {
    pub seeds: Vec<SeedRow>,
    pub gap_final: Spread,
    pub gap_val: Spread,
    /// The noise floor: fp32 against bf16 ZeRO-3, per seed.
    pub noise_final: Spread,
    pub noise_val: Spread,
    /// ZeRO-3's final loss across seeds, relative to its mean.
    pub zero3_seed_spread: Spread,
    /// Two standard errors of the mean final-loss gap
    /// (`2 · gap_final.std / sqrt(seeds)`): how far the mean of that many
    /// seeds strays when ZeRO++ only moves each run by chance.
    pub gap_margin: f64,
    /// The mean final-loss gap lies outside that margin (and outside the
    /// noise floor's own): ZeRO++ is systematically worse (or better).
    pub systematic: bool,
    /// The targets of docs/TRAINING.md: mean final-loss gap within 1%,
    /// every seed within 3%.
    pub meets_targets: bool,
}

impl Parity {
    pub fn of(rows: Vec<SeedRow>) -> Parity {
        let col = |f: &dyn Fn(&SeedRow) -> f64| rows.iter().map(f).collect::<Vec<_>>();
        let gap_final = Spread::of(&col(&|r| r.gap().0));
        let gap_val = Spread::of(&col(&|r| r.gap().1));
        let noise_final = Spread::of(&col(&|r| r.noise().0));
        let noise_val = Spread::of(&col(&|r| r.noise().1));
        let z3 = col(&|r| r.zero3_final as f64);
        let z3_mean = z3.iter().sum::<f64>() / z3.len() as f64;
        let zero3_seed_spread =
            Spread::of(&z3.iter().map(|x| x / z3_mean - 1.0).collect::<Vec<_>>());
        let n = rows.len() as f64;
        let gap_margin = 2.0 * gap_final.std / n.sqrt();
        let noise_margin = noise_final.mean.abs() + 2.0 * noise_final.std / n.sqrt();
        // A gap under 0.01% is no gap to call systematic, whatever the
        // spread (identical runs have none).
        let systematic = gap_final.mean.abs() > gap_margin.max(noise_margin).max(1e-4);
        let meets_targets = gap_final.mean.abs() <= 0.01 && gap_final.max_abs <= 0.03;
        Parity {
            seeds: rows,
            gap_final,
            gap_val,
            noise_final,
            noise_val,
            zero3_seed_spread,
            gap_margin,
            systematic,
            meets_targets,
        }
    }

    /// The table rank 0 prints.
    pub fn render(&self) -> String {
        let pct = |x: f64| format!("{:+.2}%", 100.0 * x);
        let mut s = format!(
            "\n{:>6} {:>9} {:>9} {:>9} {:>10} {:>10} {:>12}\n",
            "seed", "zero3", "zero3-f32", "zeropp", "gap", "val gap", "noise (f32)"
        );
        for r in &self.seeds {
            let (g, gv) = r.gap();
            s += &format!(
                "{:>6} {:>9.4} {:>9.4} {:>9.4} {:>10} {:>10} {:>12}\n",
                r.seed,
                r.zero3_final,
                r.zero3_fp32_final,
                r.zeropp_final,
                pct(g),
                pct(gv),
                pct(r.noise().0)
            );
        }
        let row = |name: &str, sp: &Spread| {
            format!(
                "{name:<34} mean {:>8}  spread (std) {:>7}  largest {:>7}\n",
                pct(sp.mean),
                format!("{:.2}%", 100.0 * sp.std),
                format!("{:.2}%", 100.0 * sp.max_abs)
            )
        };
        s += "\n";
        s += &row("zeropp vs zero3, final loss", &self.gap_final);
        s += &row("zeropp vs zero3, validation", &self.gap_val);
        s += &row("noise floor: zero3 fp32 vs bf16", &self.noise_final);
        s += &row("noise floor, validation", &self.noise_val);
        s += &row("zero3 across seeds (vs its mean)", &self.zero3_seed_spread);
        s += &format!(
            "mean final-loss gap {} ± {:.2}% (2 standard errors over {} seeds): {}\n",
            pct(self.gap_final.mean),
            100.0 * self.gap_margin,
            self.seeds.len(),
            if self.systematic {
                "a SYSTEMATIC gap, beyond chance and the noise floor"
            } else {
                "not distinguishable from zero"
            }
        );
        s += &format!(
            "targets (mean within 1%, every seed within 3%): {}\n",
            if self.meets_targets { "met" } else { "NOT met" }
        );
        s
    }
}

/// Runs the three runs of every seed, one after the other, on this
/// machine; prints the table and writes it to `--summary-json`.
pub fn measure(cfg: &TrainConfig, seeds: &[u64], timeout_s: Option<f64>) -> Result<Parity> {
    if cfg.checkpoint.resume.is_some() || cfg.checkpoint.checkpoint_dir.is_some() {
        bail!("--seeds measures fresh runs: drop --resume and --checkpoint-dir");
    }
    let dir = std::env::temp_dir().join(format!("zeropp-parity-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut rows = Vec::new();
    for &seed in seeds {
        let mut c = cfg.clone();
        c.run.seed = seed;
        c.output.plot = None;
        let run = |mode, name: &str, tweak: &dyn Fn(&mut TrainConfig)| {
            run_mode(
                &c,
                mode,
                &format!("seed{seed}-{name}"),
                &dir,
                timeout_s,
                tweak,
            )
        };
        let (z3, _) = run(Mode::Zero3, "zero3", &|_| {})?;
        let (f32s, _) = run(Mode::Zero3, "zero3-fp32", &|c| c.switches.fp32_comm = true)?;
        let (zpp, _) = run(Mode::Zeropp, "zeropp", &|_| {})?;
        let row = SeedRow {
            seed,
            zero3_final: z3.final_loss,
            zero3_val: z3.val_loss,
            zero3_fp32_final: f32s.final_loss,
            zero3_fp32_val: f32s.val_loss,
            zeropp_final: zpp.final_loss,
            zeropp_val: zpp.val_loss,
        };
        println!(
            "seed {seed}: zero3 {:.4}, zero3-fp32 {:.4}, zeropp {:.4} ({:+.2}%)",
            row.zero3_final,
            row.zero3_fp32_final,
            row.zeropp_final,
            100.0 * row.gap().0
        );
        rows.push(row);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let parity = Parity::of(rows);
    print!("{}", parity.render());
    if let Some(p) = &cfg.output.summary_json {
        std::fs::write(p, serde_json::to_vec_pretty(&parity)?)
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(parity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_parse_as_ranges_and_lists() {
        assert_eq!(parse_seeds("0..5").unwrap().0, vec![0, 1, 2, 3, 4]);
        assert_eq!(parse_seeds("3..=5").unwrap().0, vec![3, 4, 5]);
        assert_eq!(parse_seeds("7, 8,9").unwrap().0, vec![7, 8, 9]);
        assert!(parse_seeds("4").unwrap_err().contains("at least 2"));
        assert!(parse_seeds("a..3").unwrap_err().contains("not a seed"));
        // Counted before made; a seed twice is one sample.
        for huge in ["0..99999999999999", "0..=18446744073709551615"] {
            assert!(
                parse_seeds(huge).unwrap_err().contains("at most 1000"),
                "{huge}"
            );
        }
        assert!(parse_seeds("1,1").unwrap_err().contains("twice"));
    }

    #[test]
    fn a_gap_is_judged_against_the_noise_floor() {
        let row = |seed, z3: f32, f32s: f32, zpp: f32| SeedRow {
            seed,
            zero3_final: z3,
            zero3_val: z3,
            zero3_fp32_final: f32s,
            zero3_fp32_val: f32s,
            zeropp_final: zpp,
            zeropp_val: zpp,
        };
        // Noise of ±1%; ZeRO++ +0.5% on average: parity.
        let p = Parity::of(vec![
            row(0, 1.0, 1.01, 1.004),
            row(1, 1.0, 0.99, 1.006),
            row(2, 1.0, 1.01, 1.005),
        ]);
        assert!((p.gap_final.mean - 0.005).abs() < 1e-6, "{p:?}");
        assert!((p.noise_final.max_abs - 0.01).abs() < 1e-6);
        assert!(!p.systematic && p.meets_targets, "{p:?}");
        // Gaps that scatter around zero are chance, even when wide.
        let p = Parity::of(vec![
            row(0, 1.0, 1.001, 1.02),
            row(1, 1.0, 0.999, 0.98),
            row(2, 1.0, 1.0, 1.01),
        ]);
        assert!(!p.systematic && p.meets_targets, "{p:?}");
        // +5% on every seed against ±1% noise: a defect.
        let p = Parity::of(vec![
            row(0, 1.0, 1.01, 1.05),
            row(1, 1.0, 0.99, 1.051),
            row(2, 1.0, 1.0, 1.049),
        ]);
        assert!(p.systematic && !p.meets_targets);
        assert!(p.render().contains("SYSTEMATIC") && p.render().contains("NOT met"));
    }
}
