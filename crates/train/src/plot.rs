//! Training curves as a self-contained SVG (no plotting library), from `metrics.jsonl`: three
//! panels against the optimiser step, each with round tick values and gridlines:
//! - **loss**: the training loss, its masked-LM and next-sentence parts, and the held-out
//!   loss and masked-LM loss (dashed, a dot per evaluation) when the run evaluates;
//! - **accuracy**: masked-LM and next-sentence accuracy, training and held-out;
//! - **learning rate**.

use crate::TrainError;

const WIDTH: f64 = 960.0;
const PANEL: f64 = 280.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 30.0;
/// Space above a panel's frame (title, legend) and below it (step labels).
const TOP: f64 = 44.0;
const BOTTOM: f64 = 36.0;

fn series(rows: &[serde_json::Value], key: &str) -> Vec<(f64, f64)> {
    rows.iter()
        .filter_map(|r| Some((r["step"].as_f64()?, r[key].as_f64()?)))
        .filter(|(_, y)| y.is_finite())
        .collect()
}

/// A curve: its legend name, colour, whether it is held-out (dashed, dotted at each point),
/// and its points.
struct Curve {
    name: &'static str,
    colour: &'static str,
    heldout: bool,
    points: Vec<(f64, f64)>,
}

fn curve(rows: &[serde_json::Value], key: &str, name: &'static str, colour: &'static str) -> Curve {
    Curve {
        name,
        colour,
        heldout: key.starts_with("eval_"),
        points: series(rows, key),
    }
}

/// Round tick values covering `[lo, hi]`: multiples of 1, 2 or 5 × 10^k, about `target` of
/// them; the axis runs from the first to the last.
pub fn ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    let target = target.max(1);
    let scale = lo.abs().max(hi.abs());
    let span = hi - lo;
    if span.is_infinite() {
        // Past f64's range: the ends alone.
        return vec![lo, hi];
    }
    // A span too small to tell apart from its values (or none: a flat series) is drawn
    // around them, a tenth of their size each way (where f64 goes that far); one below
    // what f64 resolves (subnormal values), a unit each way.
    let (lo, hi) = if span > scale * 1e-9 && span.is_normal() {
        (lo, hi)
    } else if scale.is_normal() {
        let pad = scale * 0.1;
        let widened = |v: f64| if v.is_finite() { Some(v) } else { None };
        (
            widened(lo - pad).unwrap_or(lo),
            widened(hi + pad).unwrap_or(hi),
        )
    } else {
        (lo - 1.0, hi + 1.0)
    };
    let rough = (hi - lo) / target as f64;
    let magnitude = 10f64.powf(rough.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= rough)
        .unwrap_or(10.0 * magnitude);
    let (first, last) = ((lo / step).floor(), (hi / step).ceil());
    // Values at the ends of f64's range leave no round step: the ends alone.
    if !(step.is_normal() && first.is_finite() && last.is_finite())
        || last - first > 4.0 * target as f64 + 4.0
    {
        return vec![lo, hi];
    }
    let round: Vec<f64> = (first as i64..=last as i64)
        .map(|i| i as f64 * step)
        .collect();
    if round.iter().all(|t| t.is_finite()) {
        round
    } else {
        vec![lo, hi]
    }
}

/// A tick value as text: as many decimals as the tick step needs, or scientific notation for
/// very small or large values.
fn label(value: f64, step: f64) -> String {
    if value == 0.0 {
        return "0".into();
    }
    let size = value.abs();
    if !(1e-3..1e6).contains(&size) {
        let digits = ((size.log10().floor() - step.log10().floor()).max(0.0)) as usize;
        return format!("{value:.digits$e}");
    }
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    format!("{value:.decimals$}")
}

/// Draws a panel with its frame at `top`: title, gridlines at round ticks, the curves and a
/// legend. Nothing for a panel without points.
fn panel(out: &mut String, top: f64, title: &str, curves: &[Curve], x_ticks: &[f64]) {
    let curves: Vec<&Curve> = curves.iter().filter(|c| !c.points.is_empty()).collect();
    let points: Vec<&(f64, f64)> = curves.iter().flat_map(|c| c.points.iter()).collect();
    if points.is_empty() {
        return;
    }
    let (y_lo, y_hi) = points
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let y_ticks = ticks(y_lo, y_hi, 5);
    let (y0, y1) = (y_ticks[0], y_ticks[y_ticks.len() - 1]);
    let (x0, x1) = (x_ticks[0], x_ticks[x_ticks.len() - 1]);
    let (w, h) = (WIDTH - LEFT - RIGHT, PANEL - TOP - BOTTOM);
    let frame_top = top + TOP;
    let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * w;
    let sy = |y: f64| frame_top + h - (y - y0) / (y1 - y0) * h;
    out.push_str(&format!(
        "<text x=\"{LEFT}\" y=\"{:.1}\" font-size=\"15\" font-weight=\"bold\">{title}</text>\n",
        top + 18.0
    ));
    let y_step = y_ticks.get(1).map_or(1.0, |t| t - y0);
    for &t in &y_ticks {
        let y = sy(t);
        out.push_str(&format!(
            "<line x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#e4e4e4\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{}</text>\n",
            LEFT + w,
            LEFT - 6.0,
            y + 4.0,
            label(t, y_step)
        ));
    }
    let x_step = x_ticks.get(1).map_or(1.0, |t| t - x0);
    for &t in x_ticks {
        let x = sx(t);
        out.push_str(&format!(
            "<line x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{frame_top:.1}\" y2=\"{:.1}\" stroke=\"#e4e4e4\"/>\n\
             <text x=\"{x:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\">{}</text>\n",
            frame_top + h,
            frame_top + h + 15.0,
            label(t, x_step)
        ));
    }
    out.push_str(&format!(
        "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\" fill=\"#555\">step</text>\n\
         <rect x=\"{LEFT}\" y=\"{frame_top:.1}\" width=\"{w:.1}\" height=\"{h:.1}\" fill=\"none\" stroke=\"#888\"/>\n",
        LEFT + w,
        frame_top + h + 30.0
    ));
    let mut legend_x = LEFT + 200.0;
    for c in &curves {
        let pts: Vec<String> = c
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let dash = if c.heldout {
            " stroke-dasharray=\"6 3\""
        } else {
            ""
        };
        out.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.6\"{dash} points=\"{}\"/>\n",
            c.colour,
            pts.join(" ")
        ));
        if c.heldout {
            for &(x, y) in &c.points {
                out.push_str(&format!(
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{}\"/>\n",
                    sx(x),
                    sy(y),
                    c.colour
                ));
            }
        }
        out.push_str(&format!(
            "<line x1=\"{legend_x:.1}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"{}\" stroke-width=\"2\"{dash}/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\">{}</text>\n",
            legend_x + 18.0,
            top + 14.0,
            top + 14.0,
            c.colour,
            legend_x + 22.0,
            top + 18.0,
            c.name
        ));
        legend_x += 30.0 + 7.0 * c.name.len() as f64;
    }
}

/// The SVG for rows of `metrics.jsonl`.
pub fn svg(rows: &[serde_json::Value]) -> Result<String, TrainError> {
    let losses = [
        curve(rows, "loss", "loss", "#1f77b4"),
        curve(rows, "mlm_loss", "masked LM", "#ff7f0e"),
        curve(rows, "nsp_loss", "next sentence", "#2ca02c"),
        curve(rows, "eval_loss", "held-out loss", "#17becf"),
        curve(rows, "eval_mlm_loss", "held-out masked LM", "#9467bd"),
    ];
    if losses[0].points.is_empty() {
        return Err(TrainError::Data("no rows with `step` and `loss`".into()));
    }
    let accuracies = [
        curve(rows, "mlm_accuracy", "masked LM", "#ff7f0e"),
        curve(rows, "nsp_accuracy", "next sentence", "#2ca02c"),
        curve(rows, "eval_mlm_accuracy", "held-out masked LM", "#9467bd"),
        curve(
            rows,
            "eval_nsp_accuracy",
            "held-out next sentence",
            "#8c564b",
        ),
    ];
    let rates = [curve(rows, "lr", "learning rate", "#d62728")];
    let (first, last) = losses[0]
        .points
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let x_ticks = ticks(first, last, 8);
    let panels = [
        ("loss", &losses[..]),
        ("accuracy", &accuracies[..]),
        ("learning rate", &rates[..]),
    ];
    let shown = panels
        .iter()
        .filter(|(_, c)| c.iter().any(|c| !c.points.is_empty()))
        .count();
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{}\" font-family=\"sans-serif\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
        shown as f64 * PANEL + 10.0
    );
    let mut top = 0.0;
    for (title, curves) in panels {
        if curves.iter().any(|c| !c.points.is_empty()) {
            panel(&mut out, top, title, curves, &x_ticks);
            top += PANEL;
        }
    }
    out.push_str("</svg>\n");
    Ok(out)
}

/// Plots the `metrics.jsonl` at `metrics` into the SVG file `output` (written atomically);
/// returns the number of steps plotted. A line that is not JSON is an error naming the file
/// and line.
pub fn plot_file(metrics: &std::path::Path, output: &std::path::Path) -> Result<usize, TrainError> {
    let text = bertkit_stage_io::read_text(metrics).map_err(crate::io_err(metrics))?;
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
    use super::*;

    #[test]
    fn curves_become_polylines_and_held_out_ones_are_dotted() {
        let rows: Vec<serde_json::Value> = (1..=5)
            .map(|s| {
                let mut r = serde_json::json!({"step": s, "loss": 10.0 - s as f64,
                    "mlm_loss": 9.0, "nsp_loss": 0.7, "mlm_accuracy": 0.1, "nsp_accuracy": 0.5,
                    "lr": 1e-3});
                if s % 2 == 0 {
                    r["eval_loss"] = serde_json::json!(9.5);
                }
                r
            })
            .collect();
        let svg = svg(&rows).unwrap();
        // loss, mlm, nsp, held-out loss; two accuracies; the learning rate.
        assert_eq!(svg.matches("<polyline").count(), 7);
        assert_eq!(svg.matches("<circle").count(), 2);
        assert!(svg.contains(">held-out loss<"));
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(super::svg(&[]).is_err());
    }

    /// Ticks are round (1, 2 or 5 × 10^k), cover the data, and read well.
    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 200.0, 8), [0.0, 50.0, 100.0, 150.0, 200.0]);
        assert_eq!(
            ticks(6.83, 11.02, 5),
            vec![6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0]
        );
        let lr = ticks(0.0, 9.9e-3, 5);
        assert_eq!(lr.len(), 6);
        assert!((lr[5] - 1e-2).abs() < 1e-12);
        assert_eq!(label(lr[1], lr[1] - lr[0]), "0.002");
        assert_eq!(label(2e-4, 1e-4), "2e-4");
        assert_eq!(label(1.5e-4, 5e-5), "1.5e-4");
        assert_eq!(label(7.0, 1.0), "7");
        assert_eq!(label(0.25, 0.05), "0.25");
        // A flat series still gets an axis.
        assert!(ticks(0.7, 0.7, 5).len() >= 2);
    }

    /// Spans a step cannot divide (none, subnormal, nearly none, the whole of f64's range)
    /// still give a few ordered, finite ticks covering the values.
    #[test]
    fn any_finite_span_gets_a_few_ticks() {
        for (lo, hi) in [
            (0.0, 1e-323),
            (0.0, 0.0),
            (1.0, 1.0 + f64::EPSILON),
            (-f64::MAX, f64::MAX),
            (f64::MAX, f64::MAX),
            (-5e-324, 5e-324),
            (1e300, 1.0000001e300),
        ] {
            let t = ticks(lo, hi, 5);
            assert!((2..=24).contains(&t.len()), "{lo} {hi}: {t:?}");
            assert!(t.iter().all(|v| v.is_finite()), "{lo} {hi}: {t:?}");
            assert!(t.windows(2).all(|w| w[0] < w[1]), "{lo} {hi}: {t:?}");
            assert!(t[0] <= lo && hi <= t[t.len() - 1], "{lo} {hi}: {t:?}");
        }
    }
}
