//! Training curves as a self-contained SVG (no plotting library): the losses (total, MLM, NSP)
//! and the learning rate against the optimiser step.

use crate::TrainError;

const WIDTH: f64 = 900.0;
const PANEL: f64 = 260.0;
const MARGIN: f64 = 60.0;

fn series(rows: &[serde_json::Value], key: &str) -> Vec<(f64, f64)> {
    rows.iter()
        .filter_map(|r| Some((r["step"].as_f64()?, r[key].as_f64()?)))
        .filter(|(_, y)| y.is_finite())
        .collect()
}

/// A named, coloured curve.
type Curve<'a> = (&'a str, &'a str, Vec<(f64, f64)>);

fn panel(out: &mut String, top: f64, title: &str, lines: &[Curve]) {
    let points: Vec<&(f64, f64)> = lines.iter().flat_map(|l| l.2.iter()).collect();
    if points.is_empty() {
        return;
    }
    let (x0, x1) = points
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = points
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let (x1, y1) = (
        if x1 > x0 { x1 } else { x0 + 1.0 },
        if y1 > y0 { y1 } else { y0 + 1.0 },
    );
    let (w, h) = (WIDTH - 2.0 * MARGIN, PANEL - 50.0);
    let sx = |x: f64| MARGIN + (x - x0) / (x1 - x0) * w;
    let sy = |y: f64| top + 30.0 + h - (y - y0) / (y1 - y0) * h;
    out.push_str(&format!(
        "<text x=\"{MARGIN}\" y=\"{}\" font-size=\"15\">{title}</text>\n\
         <rect x=\"{MARGIN}\" y=\"{}\" width=\"{w}\" height=\"{h}\" fill=\"none\" stroke=\"#999\"/>\n",
        top + 20.0,
        top + 30.0
    ));
    for (value, y) in [
        (y0, sy(y0)),
        (y1, sy(y1)),
        ((y0 + y1) / 2.0, sy((y0 + y1) / 2.0)),
    ] {
        out.push_str(&format!(
            "<text x=\"{}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{value:.4}</text>\n",
            MARGIN - 4.0,
            y + 4.0
        ));
    }
    for (value, x) in [(x0, sx(x0)), (x1, sx(x1))] {
        out.push_str(&format!(
            "<text x=\"{x:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\">step {value:.0}</text>\n",
            top + 30.0 + h + 14.0
        ));
    }
    for (i, (name, colour, data)) in lines.iter().enumerate() {
        let pts: Vec<String> = data
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        out.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.5\" points=\"{}\"/>\n\
             <text x=\"{}\" y=\"{}\" font-size=\"12\" fill=\"{colour}\">{name}</text>\n",
            pts.join(" "),
            WIDTH - MARGIN - 200.0 + 70.0 * i as f64,
            top + 20.0
        ));
    }
}

/// The SVG for rows of `metrics.jsonl`.
pub fn svg(rows: &[serde_json::Value]) -> Result<String, TrainError> {
    let losses = [
        ("loss", "#1f77b4", series(rows, "loss")),
        ("mlm", "#ff7f0e", series(rows, "mlm_loss")),
        ("nsp", "#2ca02c", series(rows, "nsp_loss")),
    ];
    if losses[0].2.is_empty() {
        return Err(TrainError::Data("no rows with `step` and `loss`".into()));
    }
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{}\" font-family=\"sans-serif\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
        2.0 * PANEL + 20.0
    );
    panel(&mut out, 0.0, "pre-training loss", &losses);
    panel(
        &mut out,
        PANEL,
        "learning rate",
        &[("lr", "#d62728", series(rows, "lr"))],
    );
    out.push_str("</svg>\n");
    Ok(out)
}

/// Plots the `metrics.jsonl` at `metrics` into the SVG file `output` (written atomically);
/// returns the number of steps plotted. A line that is not JSON is an error naming the file
/// and line.
pub fn plot_file(metrics: &std::path::Path, output: &std::path::Path) -> Result<usize, TrainError> {
    let text = std::fs::read_to_string(metrics).map_err(crate::io_err(metrics))?;
    let rows = text
        .lines()
        .enumerate()
        .map(|(i, line)| {
            serde_json::from_str(line).map_err(|e| {
                TrainError::Data(format!("{}: line {}: {e}", metrics.display(), i + 1))
            })
        })
        .collect::<Result<Vec<serde_json::Value>, _>>()?;
    let svg = svg(&rows)?;
    bertkit_stage_io::write_atomically(output, svg.as_bytes()).map_err(crate::io_err(output))?;
    Ok(rows.len())
}

#[cfg(test)]
mod tests {
    #[test]
    fn curves_become_polylines() {
        let rows: Vec<serde_json::Value> = (1..=5)
            .map(|s| serde_json::json!({"step": s, "loss": 10.0 - s as f64, "mlm_loss": 9.0, "nsp_loss": 0.7, "lr": 1e-3}))
            .collect();
        let svg = super::svg(&rows).unwrap();
        assert_eq!(svg.matches("<polyline").count(), 4);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(super::svg(&[]).is_err());
    }
}
