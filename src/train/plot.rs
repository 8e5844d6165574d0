//! Loss curves as PNG (`zeropp train --plot FILE.png`), drawn with plotters'
//! bitmap backend and a font bundled in the binary (an ASCII subset of
//! DejaVu Sans), so no system fonts or libraries are needed.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{Result, anyhow, bail};
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

static FONT: &[u8] = include_bytes!("../../assets/DejaVuSans-ascii.ttf");

fn ensure_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    if *REGISTERED.get_or_init(|| register_font("sans-serif", FontStyle::Normal, FONT).is_ok()) {
        Ok(())
    } else {
        Err(anyhow!("the bundled plot font could not be loaded"))
    }
}

/// One line of a plot: `(step, loss)` points.
#[derive(Clone, Debug)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

/// Writes `series` as a PNG of loss against step.
pub fn loss_curves(path: &Path, title: &str, series: &[Series]) -> Result<()> {
    let finite = |(x, y): &(f64, f64)| x.is_finite() && y.is_finite();
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(finite)
        .collect();
    if all.is_empty() {
        bail!("nothing to plot in {}: no finite losses", path.display());
    }
    ensure_font()?;
    let x_max = all.iter().map(|p| p.0).fold(1.0, f64::max);
    let y_min = all.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let y_max = all.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let pad = ((y_max - y_min) * 0.05).max(1e-3);
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..x_max, (y_min - pad)..(y_max + pad))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .label_style(("sans-serif", 15))
            .draw()?;
        for (i, s) in series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(
                    s.points.iter().copied().filter(finite),
                    color.stroke_width(2),
                ))?
                .label(s.name.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow!("cannot draw the plot {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_png_with_two_curves_and_refuses_an_empty_one() {
        let dir = std::env::temp_dir().join(format!("zeropp-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("loss.png");
        let curve = |k: f64| Series {
            name: format!("run {k}"),
            points: (1..=50)
                .map(|s| (s as f64, 5.0 / (1.0 + k * s as f64)))
                .collect(),
        };
        loss_curves(&path, "loss", &[curve(0.1), curve(0.2)]).unwrap();
        let png = std::fs::read(&path).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        // Width and height from the IHDR chunk.
        assert_eq!(u32::from_be_bytes(png[16..20].try_into().unwrap()), 900);
        assert_eq!(u32::from_be_bytes(png[20..24].try_into().unwrap()), 560);
        let empty = Series {
            name: "nan".into(),
            points: vec![(1.0, f64::NAN)],
        };
        let err = loss_curves(&dir.join("x.png"), "loss", &[empty]).unwrap_err();
        assert!(err.to_string().contains("no finite losses"), "{err}");
        assert!(loss_curves(&dir.join("no/such/dir/x.png"), "loss", &[curve(0.1)]).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
