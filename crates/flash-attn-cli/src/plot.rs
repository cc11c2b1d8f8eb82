//! Figures in the style of the FlashAttention paper's: runtime vs sequence length N and, where
//! measured, peak extra memory vs N, on log-log axes, one series per implementation.
//!
//! `bench --memory --plot FILE.svg` draws the memory table's own measurements; `flash-attn plot`
//! draws saved bench JSON lines (`sq`, `fwd_ms`, optional `peak_extra_bytes` and `label`). The
//! figure is SVG with its text as `<text>` elements, so drawing needs no font files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use plotters::prelude::*;
use serde_json::Value;

use crate::bench::{fmt_bytes, fmt_count};
use crate::{CliError, Result};

/// Size of one panel in pixels.
const PANEL: (u32, u32) = (560, 420);

/// Arguments of `flash-attn plot`.
#[derive(Debug, Args)]
pub struct PlotArgs {
    /// Bench JSON lines to draw: each with `sq` and `fwd_ms`, optionally `peak_extra_bytes` and
    /// `label` (without one, the series is named from `backend`, `device`, `dtype`, `d` and
    /// `causal`).
    #[arg(long, value_name = "FILE.json")]
    from: PathBuf,

    /// The SVG file to write.
    #[arg(long, value_name = "FILE.svg")]
    output: PathBuf,

    /// Title above the panels.
    #[arg(long, default_value = "forward pass")]
    title: String,
}

/// One measured sequence length of a series.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    /// Sequence length (sq = sk).
    pub n: usize,
    /// Time of one call.
    pub ms: f64,
    /// Peak heap bytes of one call beyond what was live before it, where measured.
    pub peak_extra_bytes: Option<usize>,
}

/// One implementation's points, drawn as one line with markers.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// Points in increasing N.
    pub points: Vec<Point>,
}

/// Runs `flash-attn plot`.
pub fn main(args: &PlotArgs) -> Result<ExitCode> {
    let text = std::fs::read_to_string(&args.from)
        .map_err(|e| CliError::new(format!("cannot read {}: {e}", args.from.display())))?;
    let series = series_from_json_lines(&text).map_err(|e| CliError::new(format!("{}: {e}", args.from.display())))?;
    write_svg(&args.output, &args.title, &series)?;
    Ok(ExitCode::SUCCESS)
}

/// Parses bench JSON lines into one series per label, points sorted by N (blank lines skipped).
pub fn series_from_json_lines(text: &str) -> Result<Vec<Series>> {
    let mut by_label: BTreeMap<String, Vec<Point>> = BTreeMap::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = |msg: String| CliError::new(format!("line {}: {msg}", i + 1));
        let obj: Value = serde_json::from_str(line).map_err(|e| at(format!("not JSON: {e}")))?;
        let n = obj.get("sq").and_then(Value::as_u64).ok_or_else(|| at("no integer `sq`".to_owned()))?;
        let ms = obj.get("fwd_ms").and_then(Value::as_f64).ok_or_else(|| at("no number `fwd_ms`".to_owned()))?;
        let peak_extra_bytes = obj.get("peak_extra_bytes").and_then(Value::as_u64).map(|b| b as usize);
        by_label.entry(label_of(&obj)).or_default().push(Point { n: n as usize, ms, peak_extra_bytes });
    }
    if by_label.is_empty() {
        return Err(CliError::new("no JSON lines to plot"));
    }
    Ok(by_label
        .into_iter()
        .map(|(label, mut points)| {
            points.sort_by_key(|p| p.n);
            Series { label, points }
        })
        .collect())
}

/// `label` if the line has one, else what tells its series apart in a bench grid: the backend
/// (ours unless `backend` says otherwise), device, dtype, head dim and mask.
fn label_of(obj: &Value) -> String {
    if let Some(label) = obj.get("label").and_then(Value::as_str) {
        return label.to_owned();
    }
    let mut parts = vec![obj.get("backend").and_then(Value::as_str).unwrap_or("flash-attn").to_owned()];
    parts.extend(["device", "dtype"].iter().filter_map(|k| obj.get(*k).and_then(Value::as_str)).map(str::to_owned));
    if let Some(d) = obj.get("d").and_then(Value::as_u64) {
        parts.push(format!("d={d}"));
    }
    if obj.get("causal").and_then(Value::as_bool) == Some(true) {
        parts.push("causal".to_owned());
    }
    parts.join(" ")
}

/// Draws `series` and writes the SVG to `path` (only once it is drawn).
pub fn write_svg(path: &Path, title: &str, series: &[Series]) -> Result<()> {
    let svg = svg(title, series)?;
    std::fs::write(path, svg).map_err(|e| CliError::new(format!("cannot write {}: {e}", path.display())))
}

/// The figure as SVG text: a runtime panel and, if any point has a peak, a memory panel.
pub fn svg(title: &str, series: &[Series]) -> Result<String> {
    let with_memory = series.iter().flat_map(|s| &s.points).any(|p| p.peak_extra_bytes.is_some());
    let panels = if with_memory { 2 } else { 1 };
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (PANEL.0 * panels, PANEL.1 + 40)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_error)?;
        let root = root.titled(title, ("sans-serif", 26)).map_err(draw_error)?;
        let areas = root.split_evenly((1, panels as usize));
        let runtime: Vec<Vec<(f64, f64)>> =
            series.iter().map(|s| s.points.iter().map(|p| (p.n as f64, p.ms)).collect()).collect();
        // Times rise with N in every series, so the lower right stays free.
        let runtime_axis =
            Axis { caption: "runtime", desc: "time", base: 10.0, legend: SeriesLabelPosition::LowerRight };
        panel(&areas[0], runtime_axis, series, &runtime, &|ms| tick_time(*ms))?;
        if with_memory {
            let memory: Vec<Vec<(f64, f64)>> = series
                .iter()
                .map(|s| s.points.iter().filter_map(|p| Some((p.n as f64, p.peak_extra_bytes? as f64))).collect())
                .collect();
            // FlashAttention's flat line runs along the bottom and Algorithm 0 stops at its largest N, high
            // up: the middle right stays free.
            let memory_axis = Axis {
                caption: "peak extra memory",
                desc: "bytes",
                base: 2.0,
                legend: SeriesLabelPosition::MiddleRight,
            };
            panel(&areas[1], memory_axis, series, &memory, &|b| fmt_bytes(b.round() as usize).replace(".0 ", " "))?;
        }
        root.present().map_err(draw_error)?;
    }
    Ok(out)
}

/// Colours of the series, in order (Algorithm 0 first in the memory figure).
const COLOURS: [RGBColor; 6] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// What a panel shows on its y axis, and where its legend goes.
struct Axis {
    caption: &'static str,
    desc: &'static str,
    /// Base of the log scale, whose powers are the ticks.
    base: f64,
    legend: SeriesLabelPosition,
}

/// One log-log panel: N on x (powers of two), `ys` on y; non-positive values (a log axis has no
/// place for them) are left out.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    y_axis: Axis,
    series: &[Series],
    ys: &[Vec<(f64, f64)>],
    y_format: &dyn Fn(&f64) -> String,
) -> Result<()> {
    let ys: Vec<Vec<(f64, f64)>> =
        ys.iter().map(|pts| pts.iter().copied().filter(|&(x, y)| x > 0.0 && y > 0.0).collect()).collect();
    let all = || ys.iter().flatten();
    let (x_min, x_max) = all().fold((f64::INFINITY, 0.0f64), |(lo, hi), &(x, _)| (lo.min(x), hi.max(x)));
    let (y_min, y_max) = all().fold((f64::INFINITY, 0.0f64), |(lo, hi), &(_, y)| (lo.min(y), hi.max(y)));
    if !x_min.is_finite() {
        return Err(CliError::new(format!("nothing to plot in the {} panel", y_axis.caption)));
    }
    let mut chart = ChartBuilder::on(area)
        .caption(y_axis.caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(
            (x_min / 1.2..x_max * 1.2).log_scale().base(2.0),
            (y_min / 2.0..y_max * 2.0).log_scale().base(y_axis.base),
        )
        .map_err(draw_error)?;
    chart
        .configure_mesh()
        .x_desc("sequence length N")
        .y_desc(y_axis.desc)
        .x_label_formatter(&|n| fmt_count(n.round() as usize))
        .y_label_formatter(y_format)
        .label_style(("sans-serif", 16))
        .draw()
        .map_err(draw_error)?;
    for (i, (s, pts)) in series.iter().zip(&ys).enumerate() {
        if pts.is_empty() {
            continue;
        }
        let colour = COLOURS[i % COLOURS.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), colour.stroke_width(2)))
            .map_err(draw_error)?
            .label(s.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
        chart
            .draw_series(PointSeries::of_element(pts.iter().copied(), 4, colour.filled(), &|c, size, style| {
                Circle::new(c, size, style)
            }))
            .map_err(draw_error)?;
    }
    chart
        .configure_series_labels()
        .position(y_axis.legend)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()
        .map_err(draw_error)?;
    Ok(())
}

/// A tick of the time axis: `0.1 ms`, `10 ms`, `1 s` (three significant digits at most).
fn tick_time(ms: f64) -> String {
    let (x, unit) = if ms >= 1000.0 { (ms / 1e3, "s") } else { (ms, "ms") };
    let digits = (2 - x.abs().log10().floor() as i32).max(0) as usize;
    let text = format!("{x:.digits$}");
    let text = if text.contains('.') { text.trim_end_matches('0').trim_end_matches('.') } else { &text };
    format!("{text} {unit}")
}

/// A drawing failure as the CLI's one-line error.
fn draw_error<E: std::error::Error + Send + Sync>(e: plotters::drawing::DrawingAreaErrorKind<E>) -> CliError {
    CliError::new(format!("cannot draw the figure: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_group_by_label_and_sort_by_n() {
        let text = "{\"label\":\"torch\",\"sq\":2048,\"fwd_ms\":2.0}\n\n\
                    {\"label\":\"torch\",\"sq\":1024,\"fwd_ms\":1.0}\n\
                    {\"device\":\"cuda\",\"dtype\":\"bf16\",\"d\":64,\"causal\":true,\"sq\":512,\"fwd_ms\":0.5,\"peak_extra_bytes\":null}\n";
        let series = series_from_json_lines(text).expect("parses");
        assert_eq!(series.len(), 2);
        assert_eq!(series[0].label, "flash-attn cuda bf16 d=64 causal");
        assert_eq!(series[1].label, "torch");
        assert_eq!(series[1].points.iter().map(|p| p.n).collect::<Vec<_>>(), [1024, 2048]);
        assert_eq!(series[0].points[0].peak_extra_bytes, None);
    }

    #[test]
    fn json_line_without_fwd_ms_is_rejected_with_its_line_number() {
        let err = series_from_json_lines("{\"sq\":1024,\"fwd_ms\":1.0}\n{\"sq\":2048}\n").expect_err("rejected");
        assert!(err.to_string().starts_with("line 2:"), "{err}");
    }

    #[test]
    fn time_ticks_are_short() {
        assert_eq!(tick_time(0.1 + 1e-17), "0.1 ms");
        assert_eq!(tick_time(10.000000001), "10 ms");
        assert_eq!(tick_time(1000.0), "1 s");
        assert_eq!(tick_time(2.5e4), "25 s");
    }

    #[test]
    fn figure_has_both_panels_and_every_label_as_text() {
        let point = |n: usize, ms: f64, b: Option<usize>| Point { n, ms, peak_extra_bytes: b };
        let series = [
            Series {
                label: "Algorithm 0".into(),
                points: vec![point(1024, 4.0, Some(4 << 20)), point(2048, 16.0, None)],
            },
            Series {
                label: "FlashAttention".into(),
                points: vec![point(1024, 1.0, Some(0)), point(2048, 2.0, Some(4096))],
            },
        ];
        let svg = svg("test", &series).expect("draws");
        for text in ["Algorithm 0", "FlashAttention", "runtime", "peak extra memory", "<text"] {
            assert!(svg.contains(text), "{text} missing");
        }
    }
}
