//! `dflash-supervise report`: a run's story in one self-contained XHTML page with inline
//! SVG (no script, no network): a summary table that leads with what the drafter is worth
//! (the last real τ, the best checkpoint, the last held-out eval), loss and acceptance
//! (with the per-slot accuracy) per step with the learning rate, real τ, trained tokens/s,
//! per-GPU utilisation, memory, power, temperature and SM clock with throttle reasons and
//! XIDs marked, pool fill and the bottleneck hint, phase timings per worker, batch
//! composition, and worker lifelines on a shared time axis. Value axes fit their data
//! (shares stay 0–100%); a lone point is drawn inside its plot with its value beside it;
//! lane names get a margin as wide as the longest. It reads whatever the run wrote, so it
//! works on a finished, a crashed (last line cut off) or a live run; a series the run did
//! not record is named on the page with the reason, never an error. `--watch` rewrites
//! the page at every new metrics window until the run ends.
//!
//! The SVG is written by hand (a few hundred lines below): the page must be strict XML
//! with stable classes and `data-*` attributes on every point and marker, which the tests
//! and any script read back, and a plotting crate's SVG backend gives neither.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::Error;
use crate::run::rundir::read_jsonl;
use crate::telemetry::window::{Agg, Gpu, Pipeline, Pool, Window};

/// The committed steps of the final lineage: a rollback line drops the steps after its
/// target (they were trained again).
pub fn lineage_steps(train: &[Value]) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    for l in train {
        if let Some(to) = l["rollback"]["to"].as_u64() {
            out.retain(|s| s["step"].as_u64().is_some_and(|n| n <= to));
        } else if l.get("step").is_some() {
            out.push(l.clone());
        }
    }
    out
}

/// The held-out evals (`{"eval": {...}}` lines) of the final lineage, by step.
pub fn lineage_evals(train: &[Value]) -> Vec<Value> {
    lineage_records(train, "eval")
}

/// The `{kind: {"step", ...}}` lines of the final lineage (a rollback drops those of the
/// steps after its target), in order.
fn lineage_records(train: &[Value], kind: &str) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    for l in train {
        if let Some(to) = l["rollback"]["to"].as_u64() {
            out.retain(|e| e["step"].as_u64().is_some_and(|n| n <= to));
        } else if l[kind].is_object() {
            out.push(l[kind].clone());
        }
    }
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn ms_of(t: &Value) -> Option<f64> {
    ms_of_str(t.as_str()?)
}

/// [`ms_of`] of a time already read as a string.
fn ms_of_str(t: &str) -> Option<f64> {
    humantime::parse_rfc3339(t)
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_secs_f64() * 1e3)
}

/// A figure for a table cell: integers as they are, others with 4 significant digits.
fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        return "–".into();
    }
    let a = v.abs();
    if a >= 1e9 {
        format!("{:.2}G", v / 1e9)
    } else if a >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.4}")
    }
}

/// "1m05s", "2h03m", "4.2s".
fn fmt_dur(s: f64) -> String {
    if s < 10.0 && s.fract().abs() > 1e-9 {
        return format!("{s:.1}s");
    }
    let s = s.round() as u64;
    match (s / 3600, (s / 60) % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, 0) => format!("{m}m"),
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, 0, _) => format!("{h}h"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

/// Weighted mean and weighted p10/p90 of (value, weight) pairs.
fn weighted_stats(v: &[(f64, f64)]) -> Option<(f64, f64, f64)> {
    let mut v: Vec<(f64, f64)> = v
        .iter()
        .copied()
        .filter(|(x, w)| x.is_finite() && *w > 0.0)
        .collect();
    let total: f64 = v.iter().map(|p| p.1).sum();
    if v.is_empty() || total <= 0.0 {
        return None;
    }
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mean = v.iter().map(|(x, w)| x * w).sum::<f64>() / total;
    let q = |p: f64| {
        let mut acc = 0.0;
        for (x, w) in &v {
            acc += w;
            if acc >= p * total {
                return *x;
            }
        }
        v[v.len() - 1].0
    };
    Some((mean, q(0.1), q(0.9)))
}

// ----------------------------------------------------------------------------------------
// Charts

const W: f64 = 900.0;
const PALETTE: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    "#bcbd22", "#7f7f7f",
];

fn nice_step(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(1e-12);
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    (if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    }) * mag
}

/// A value axis that fits `vals`: from their least to their greatest with a margin of 5% of
/// the span each side, so no point lies on the plot's border. It reaches 0 only when the
/// data comes near it (0 within a quarter of the span: a loss from 8 to 0.2 is drawn from
/// 0, one from 11.9 to 11.6 is not); equal values (one point) get ±10% around their value.
fn fit(vals: impl IntoIterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in vals.into_iter().filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let span = hi - lo;
    if span <= 1e-9 * hi.abs().max(lo.abs()) {
        let d = if hi == 0.0 { 1.0 } else { hi.abs() * 0.1 };
        return (lo - d, hi + d);
    }
    let margin = span * 0.05;
    let lo = if lo >= 0.0 && lo <= span * 0.25 {
        0.0
    } else {
        lo - margin
    };
    let hi = if hi <= 0.0 && -hi <= span * 0.25 {
        0.0
    } else {
        hi + margin
    };
    (lo, hi)
}

/// About `n` tick values at round steps (1, 2 or 5 × a power of 10, the one giving the
/// count nearest `n`) within `lo..=hi`, and the step.
fn ticks(lo: f64, hi: f64, n: f64) -> (Vec<f64>, f64) {
    let span = (hi - lo).max(1e-12);
    let mag = 10f64.powf((span / n).log10().floor());
    let st = [0.5, 1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|f| f * mag)
        .min_by(|a, b| {
            let off = |st: f64| (span / st / n).ln().abs();
            off(*a).total_cmp(&off(*b))
        })
        .unwrap_or(mag);
    (ticks_at(lo, hi, st), st)
}

/// The multiples of `st` within `lo..=hi` (at most 50); computed as multiples, not by
/// adding, so an integer tick is exactly an integer.
fn ticks_at(lo: f64, hi: f64, st: f64) -> Vec<f64> {
    let first = (lo / st - 1e-6).ceil() as i64;
    let last = (hi / st + 1e-6).floor() as i64;
    (first..=last)
        .take(50)
        .map(|k| if k == 0 { 0.0 } else { k as f64 * st })
        .collect()
}

fn tick_label(v: f64, step: f64) -> String {
    if v.abs() >= 1e4 {
        return fmt_num(v);
    }
    let d = if step >= 1.0 {
        0
    } else {
        (-step.log10()).ceil().clamp(0.0, 8.0) as usize
    };
    format!("{v:.d$}")
}

fn time_ticks(lo: f64, hi: f64) -> Vec<f64> {
    const STEPS: [f64; 21] = [
        0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0,
        3600.0, 7200.0, 10800.0, 21600.0, 43200.0, 86400.0,
    ];
    let st = STEPS
        .iter()
        .copied()
        .find(|s| (hi - lo) / s <= 8.0)
        .unwrap_or(86400.0);
    ticks_at(lo, hi, st)
}

/// Where a chart's data lands on its SVG.
struct Frame {
    x: (f64, f64),
    yl: (f64, f64),
    yr: (f64, f64),
    left: f64,
    right: f64,
    top: f64,
    bottom: f64,
}

impl Frame {
    fn px(&self, x: f64) -> f64 {
        self.left + (x - self.x.0) / (self.x.1 - self.x.0).max(1e-12) * (self.right - self.left)
    }
    fn py(&self, y: f64) -> f64 {
        self.bottom
            - (y - self.yl.0) / (self.yl.1 - self.yl.0).max(1e-300) * (self.bottom - self.top)
    }
    fn pyr(&self, y: f64) -> f64 {
        self.bottom
            - (y - self.yr.0) / (self.yr.1 - self.yr.0).max(1e-300) * (self.bottom - self.top)
    }
}

/// `pts` (in x order) thinned to the plot's pixel columns: where a column holds more than
/// four points, its first, lowest, highest and last, in x order; shorter runs unchanged.
fn per_pixel(pts: &[(f64, f64)], f: &Frame) -> Vec<(f64, f64)> {
    let columns = (f.right - f.left).max(1.0);
    if (pts.len() as f64) <= 2.0 * columns {
        return pts.to_vec();
    }
    let mut out = Vec::with_capacity(4 * columns as usize + 4);
    let mut i = 0;
    while i < pts.len() {
        let col = f.px(pts[i].0).floor();
        let mut j = i;
        while j < pts.len() && f.px(pts[j].0).floor() == col {
            j += 1;
        }
        let group = &pts[i..j];
        if group.len() <= 4 {
            out.extend_from_slice(group);
        } else {
            let lo = (0..group.len())
                .min_by(|&a, &b| group[a].1.total_cmp(&group[b].1))
                .unwrap_or(0);
            let hi = (0..group.len())
                .max_by(|&a, &b| group[a].1.total_cmp(&group[b].1))
                .unwrap_or(0);
            let mut keep = vec![0, lo, hi, group.len() - 1];
            keep.sort_unstable();
            keep.dedup();
            out.extend(keep.into_iter().map(|k| group[k]));
        }
        i = j;
    }
    out
}

struct Series {
    name: String,
    /// `class` of its polyline (and of its points when `dots`); `attrs` are added to both.
    class: String,
    attrs: String,
    color: String,
    pts: Vec<(f64, f64)>,
    right: bool,
    dash: Option<&'static str>,
    /// One `<circle class=.. data-step=.. data-value=..>` per point.
    dots: bool,
    /// The last point's value written beside it (and a lone point's, unless `unlabelled`).
    label_last: bool,
    label_lone: bool,
}

impl Series {
    fn new(name: impl Into<String>, class: &str, color: &str, pts: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.into(),
            class: class.into(),
            attrs: String::new(),
            color: color.into(),
            pts,
            right: false,
            dash: None,
            dots: false,
            label_last: false,
            label_lone: true,
        }
    }
    fn attrs(mut self, a: String) -> Series {
        self.attrs = a;
        self
    }
    fn right(mut self) -> Series {
        self.right = true;
        self
    }
    fn dash(mut self, d: &'static str) -> Series {
        self.dash = Some(d);
        self
    }
    fn dots(mut self) -> Series {
        self.dots = true;
        self
    }
    fn label_last(mut self) -> Series {
        self.label_last = true;
        self
    }
    fn unlabelled(mut self) -> Series {
        self.label_lone = false;
        self
    }
}

enum XAxis {
    Steps,
    /// Seconds since the run started.
    Time,
    /// Drafted positions of a block (1 to block size − 1).
    Positions,
}

struct Chart {
    id: String,
    title: String,
    x_axis: XAxis,
    x: (f64, f64),
    y_label: String,
    yl: Option<(f64, f64)>,
    y_right: Option<(String, (f64, f64))>,
    series: Vec<Series>,
    /// Legend entries without a line (colour, name).
    legend_extra: Vec<(String, String)>,
    plot_h: f64,
    left: f64,
    y_ticks: bool,
    /// Vertical markers (x, label): on the time charts, each --resume.
    marks: Vec<(f64, String)>,
    /// A chart of lanes (one row per worker or GPU): each lane's name, left of the plot,
    /// in a font of this size.
    lanes: Vec<String>,
    lane_font: f64,
}

/// Distinct ids for the charts' clip paths within a page.
static CLIP_IDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Chart {
    fn new(
        id: &str,
        title: impl Into<String>,
        x_axis: XAxis,
        x: (f64, f64),
        y_label: impl Into<String>,
    ) -> Chart {
        Chart {
            id: id.into(),
            title: title.into(),
            x_axis,
            x,
            y_label: y_label.into(),
            yl: None,
            y_right: None,
            series: Vec::new(),
            legend_extra: Vec::new(),
            plot_h: 150.0,
            left: 64.0,
            y_ticks: true,
            marks: Vec::new(),
            lanes: Vec::new(),
            lane_font: 12.0,
        }
    }

    /// One lane of `row_h` px per name, each named left of the plot: the margin is as wide
    /// as the longest name (a name too long for a third of the page gets a smaller font),
    /// so no name is cut off.
    fn lanes(mut self, names: &[String], row_h: f64) -> Chart {
        (self.left, self.lane_font) = label_margin(names, 12.0, 110.0);
        self.y_ticks = false;
        self.plot_h = row_h * names.len() as f64;
        self.lanes = names.to_vec();
        self
    }

    /// The x range the plot shows: the data's, with a margin each side (2% of the span, at
    /// least half a step, on a step axis; 1% on a time axis) so that a point or a marker at
    /// either end is drawn whole.
    fn x_shown(&self) -> (f64, f64) {
        let span = self.x.1 - self.x.0;
        let pad = match self.x_axis {
            XAxis::Steps | XAxis::Positions => (span * 0.02).max(0.5),
            XAxis::Time => (span * 0.01).max(1e-3),
        };
        (self.x.0 - pad, self.x.1 + pad)
    }

    /// Each lane's name, left of the plot, on its row's middle.
    fn lane_labels(&self, f: &Frame) -> String {
        let row_h = (f.bottom - f.top) / self.lanes.len().max(1) as f64;
        let mut s = String::new();
        for (i, name) in self.lanes.iter().enumerate() {
            let _ = write!(
                s,
                r#"<text class="lane-label" x="{LANE_X}" y="{:.1}" font-size="{:.1}">{}</text>"#,
                f.top + row_h * (i as f64 + 0.5) + self.lane_font / 3.0,
                self.lane_font,
                esc(name)
            );
        }
        s
    }

    /// Markers at `xs` labelled `label` (e.g. the resumes on a time chart).
    fn marks(mut self, xs: &[f64], label: &str) -> Chart {
        self.marks = xs.iter().map(|&x| (x, label.to_string())).collect();
        self
    }

    /// More vertical markers, each with its own label.
    fn more_marks(mut self, marks: Vec<(f64, String)>) -> Chart {
        self.marks.extend(marks);
        self
    }

    /// The SVG, with `extra` drawn over the plot (markers, bars).
    fn render(&self, extra: &dyn Fn(&Frame) -> String) -> String {
        let yl = self.yl.unwrap_or_else(|| {
            fit(self
                .series
                .iter()
                .filter(|s| !s.right)
                .flat_map(|s| s.pts.iter().map(|p| p.1)))
        });
        let right = if self.y_right.is_some() {
            W - 64.0
        } else {
            W - 24.0
        };
        let (legend, top) = self.legend(right);
        let bottom = top + self.plot_h;
        let height = bottom + 36.0;
        let f = Frame {
            x: self.x_shown(),
            yl,
            yr: self.y_right.as_ref().map_or((0.0, 1.0), |r| r.1),
            left: self.left,
            right,
            top,
            bottom,
        };
        // As wide as the page lets it be, the height following (the viewBox).
        let mut s = format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-chart="{}" width="100%" viewBox="0 0 {W} {height:.0}" font-family="sans-serif">"#,
            esc(&self.id)
        );
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="16" font-size="13" font-weight="bold">{}</text>{legend}"#,
            self.left,
            esc(&self.title)
        );
        let _ = write!(
            s,
            r##"<rect class="plot-area" x="{:.1}" y="{top:.1}" width="{:.1}" height="{:.1}" fill="#fcfcfc" stroke="#999"/>"##,
            f.left,
            f.right - f.left,
            self.plot_h
        );
        s.push_str(&self.lane_labels(&f));
        s.push_str(&self.y_axes(&f));
        s.push_str(&self.x_axis_svg(&f));
        // Everything drawn over the plot stays inside it (a point outside the axes'
        // range, a marker past its end).
        let clip = format!(
            "clip{}",
            CLIP_IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let _ = write!(
            s,
            r#"<defs><clipPath id="{clip}"><rect x="{:.1}" y="{top:.1}" width="{:.1}" height="{:.1}"/></clipPath></defs><g class="plot" clip-path="url(#{clip})">"#,
            f.left,
            f.right - f.left,
            self.plot_h
        );
        s.push_str(&self.lines(&f));
        s.push_str(&extra(&f));
        for (x, label) in &self.marks {
            let px = f.px(*x);
            let _ = write!(
                s,
                r##"<line class="mark" data-x="{x:.3}" x1="{px:.1}" y1="{top:.1}" x2="{px:.1}" y2="{bottom:.1}" stroke="#7a3" stroke-dasharray="4 3"><title>{}</title></line><text x="{:.1}" y="{:.1}" font-size="10" fill="#7a3">{}</text>"##,
                esc(label),
                px + 3.0,
                top + 11.0,
                esc(label)
            );
        }
        s.push_str("</g></svg>");
        s
    }

    /// The legend's rows above the plot (a plot `right` px wide), and where the plot's top
    /// then is.
    fn legend(&self, right: f64) -> (String, f64) {
        // Legend rows above the plot.
        let mut items: Vec<(String, Option<&'static str>, String)> = self
            .series
            .iter()
            .filter(|s| !s.name.is_empty())
            .map(|s| (s.color.clone(), s.dash, s.name.clone()))
            .collect();
        items.extend(
            self.legend_extra
                .iter()
                .map(|(c, n)| (c.clone(), None, n.clone())),
        );
        let mut legend = String::new();
        let (mut lx, mut row) = (self.left, 0.0);
        for (color, dash, name) in &items {
            let w = 26.0 + name.chars().count() as f64 * 6.3 + 14.0;
            if lx + w > right && lx > self.left {
                lx = self.left;
                row += 1.0;
            }
            let y = 36.0 + row * 15.0;
            let d = dash
                .map(|d| format!(r#" stroke-dasharray="{d}""#))
                .unwrap_or_default();
            let _ = write!(
                legend,
                r#"<line x1="{lx:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="2.5"{d}/><text x="{:.1}" y="{y:.1}" font-size="11">{}</text>"#,
                y - 4.0,
                lx + 20.0,
                y - 4.0,
                lx + 24.0,
                esc(name)
            );
            lx += w;
        }
        let top = if items.is_empty() {
            30.0
        } else {
            46.0 + row * 15.0
        };
        (legend, top)
    }

    /// The y axes' ticks and labels: the left one (unless `y_ticks` is off) and the right
    /// one when there is one.
    fn y_axes(&self, f: &Frame) -> String {
        let (top, bottom) = (f.top, f.bottom);
        let mut s = String::new();
        if self.y_ticks {
            let (ts, st) = ticks(f.yl.0, f.yl.1, 4.0);
            for t in ts {
                let y = f.py(t);
                let _ = write!(
                    s,
                    r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e4e4e4"/><text x="{:.1}" y="{:.1}" font-size="10" text-anchor="end">{}</text>"##,
                    f.left,
                    f.right,
                    f.left - 4.0,
                    y + 3.5,
                    tick_label(t, st)
                );
            }
            let _ = write!(
                s,
                r#"<text transform="translate(12 {:.1}) rotate(-90)" font-size="11" text-anchor="middle">{}</text>"#,
                (top + bottom) / 2.0,
                esc(&self.y_label)
            );
        }
        if let Some((label, r)) = &self.y_right {
            let (ts, st) = ticks(r.0, r.1, 4.0);
            for t in ts {
                let _ = write!(
                    s,
                    r#"<text x="{:.1}" y="{:.1}" font-size="10">{}</text>"#,
                    f.right + 4.0,
                    f.pyr(t) + 3.5,
                    tick_label(t, st)
                );
            }
            let _ = write!(
                s,
                r#"<text transform="translate({:.1} {:.1}) rotate(90)" font-size="11" text-anchor="middle">{}</text>"#,
                W - 8.0,
                (top + bottom) / 2.0,
                esc(label)
            );
        }
        s
    }

    /// The x axis's ticks and label, in steps or in time since the run started.
    fn x_axis_svg(&self, f: &Frame) -> String {
        let bottom = f.bottom;
        let mut s = String::new();
        let (xticks, xlabel): (Vec<(f64, String)>, &str) = match self.x_axis {
            XAxis::Steps | XAxis::Positions => {
                // Whole steps (positions) only.
                let st = nice_step(self.x.1 - self.x.0, 8.0).max(1.0);
                (
                    ticks_at(self.x.0, self.x.1, st)
                        .into_iter()
                        .map(|t| (t, tick_label(t, st)))
                        .collect(),
                    match self.x_axis {
                        XAxis::Positions => "drafted position in the block",
                        _ => "step",
                    },
                )
            }
            XAxis::Time => (
                time_ticks(self.x.0, self.x.1)
                    .into_iter()
                    .map(|t| (t, fmt_dur(t)))
                    .collect(),
                "time since the run started",
            ),
        };
        for (t, label) in xticks {
            let x = f.px(t);
            let _ = write!(
                s,
                r##"<line x1="{x:.1}" y1="{bottom:.1}" x2="{x:.1}" y2="{:.1}" stroke="#999"/><text x="{x:.1}" y="{:.1}" font-size="10" text-anchor="middle">{label}</text>"##,
                bottom + 4.0,
                bottom + 15.0
            );
        }
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="middle">{xlabel}</text>"#,
            (f.left + f.right) / 2.0,
            bottom + 30.0
        );
        s
    }

    /// The series' lines (broken where a value is missing), and their dots.
    fn lines(&self, f: &Frame) -> String {
        let mut s = String::new();
        for se in &self.series {
            let y = |v: f64| if se.right { f.pyr(v) } else { f.py(v) };
            let d = se
                .dash
                .map(|d| format!(r#" stroke-dasharray="{d}""#))
                .unwrap_or_default();
            // A missing value breaks the line; a long one keeps, per pixel column, its
            // first, lowest, highest and last points (the extremes stay visible).
            for seg in se
                .pts
                .split(|p| !p.1.is_finite() || !p.0.is_finite())
                .filter(|g| !g.is_empty())
            {
                let pts: Vec<String> = per_pixel(seg, f)
                    .iter()
                    .map(|(a, b)| format!("{:.1},{:.1}", f.px(*a), y(*b)))
                    .collect();
                let _ = write!(
                    s,
                    r#"<polyline class="{}"{} fill="none" stroke="{}" stroke-width="1.5"{d} points="{}"/>"#,
                    esc(&se.class),
                    se.attrs,
                    se.color,
                    pts.join(" ")
                );
            }
            if se.dots {
                s.push_str(&self.dots(se, f));
            }
        }
        s
    }

    /// A series' dots: as many as the plot has pixel columns at most (each column's
    /// extremes), each with its value on hover. A lone point is drawn larger, and it (or
    /// the last point, with `label_last`) has its value written beside it.
    fn dots(&self, se: &Series, f: &Frame) -> String {
        let y = |v: f64| if se.right { f.pyr(v) } else { f.py(v) };
        let finite: Vec<(f64, f64)> = se
            .pts
            .iter()
            .copied()
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .collect();
        let lone = finite.len() == 1;
        let mut s = String::new();
        for (a, b) in per_pixel(&finite, f) {
            let _ = write!(
                s,
                r#"<circle class="{}" data-step="{a}" data-value="{b:.6e}"{} cx="{:.1}" cy="{:.1}" r="{}" fill="{}"><title>{}: {} at {}</title></circle>"#,
                esc(&se.class),
                se.attrs,
                f.px(a),
                y(b),
                if lone { "3.5" } else { "1.6" },
                se.color,
                esc(if se.name.is_empty() {
                    &self.y_label
                } else {
                    &se.name
                }),
                fmt_num(b),
                match self.x_axis {
                    XAxis::Steps => format!("step {a}"),
                    XAxis::Time => fmt_dur(a),
                    XAxis::Positions => format!("position {a}"),
                }
            );
        }
        if let Some(&(a, b)) = finite
            .last()
            .filter(|_| (lone && se.label_lone) || se.label_last)
        {
            s.push_str(&value_label(
                &se.class,
                &se.color,
                (a, b),
                (f.px(a), y(b)),
                f,
            ));
        }
        s
    }
}

/// The value `v` (of the point of `class` at `x`) written beside its point at (`px`,
/// `py`): right of it in the plot's left half, left of it in the right half; above it,
/// or below it near the plot's top; so it stays inside the plot.
fn value_label(
    class: &str,
    color: &str,
    (x, v): (f64, f64),
    (px, py): (f64, f64),
    f: &Frame,
) -> String {
    let right_half = px > (f.left + f.right) / 2.0;
    let (tx, anchor) = if right_half {
        (px - 6.0, "end")
    } else {
        (px + 6.0, "start")
    };
    let ty = if py - f.top < 16.0 {
        py + 14.0
    } else {
        py - 6.0
    };
    format!(
        r#"<text class="value-label" data-for="{}" data-step="{x}" data-value="{v:.6e}" x="{tx:.1}" y="{ty:.1}" font-size="11" font-weight="bold" fill="{color}" text-anchor="{anchor}">{}</text>"#,
        esc(class),
        fmt_value(v)
    )
}

/// A value for a label: 4 significant digits ("1.000", "11.60", "0.2334"); large ones
/// as `fmt_num` writes them.
fn fmt_value(v: f64) -> String {
    if !v.is_finite() || v.abs() >= 1e4 {
        return fmt_num(v);
    }
    let d = if v == 0.0 {
        3
    } else {
        (3 - v.abs().log10().floor() as i64).clamp(0, 8) as usize
    };
    format!("{v:.d$}")
}

/// The left margin (at least `min`) that holds the longest of `names` at `font` px from
/// `LANE_X`, and the font to write them in: a name wider than a third of the page shrinks
/// the font instead, so every name fits.
fn label_margin(names: &[String], font: f64, min: f64) -> (f64, f64) {
    let widest = names
        .iter()
        .map(|n| text_width(n, font))
        .fold(0.0f64, f64::max);
    let room = W / 3.0 - LANE_X - LANE_GAP;
    if widest <= room {
        (min.max(LANE_X + widest + LANE_GAP), font)
    } else {
        (W / 3.0, font * room / widest)
    }
}

/// Where lane names start, and the gap between the longest and the plot.
const LANE_X: f64 = 6.0;
const LANE_GAP: f64 = 10.0;

/// A generous estimate of how wide `s` is in a sans-serif font of `font` px: per
/// character, 0.95 em for the widest letters, 0.75 em for capitals, digits and other
/// scripts, 0.62 em for the rest. No text metrics are at hand, so it errs wide.
fn text_width(s: &str, font: f64) -> f64 {
    s.chars()
        .map(|c| match c {
            'm' | 'w' | 'M' | 'W' | '@' | '%' => 0.95,
            c if c.is_ascii_uppercase() || c.is_ascii_digit() || !c.is_ascii() => 0.75,
            _ => 0.62,
        })
        .sum::<f64>()
        * font
}

// ----------------------------------------------------------------------------------------
// The run

struct Run {
    dir: PathBuf,
    state: Value,
    train: Vec<Value>,
    steps: Vec<Value>,
    events: Vec<Value>,
    metrics: Vec<Window>,
    torn: Vec<&'static str>,
    /// Unix ms of the start, and of the end of what was recorded.
    t0: f64,
    t1: f64,
    live: bool,
    ended: Option<Value>,
}

impl Run {
    fn read(dir: &Path) -> Run {
        let state: Value = std::fs::read_to_string(dir.join("state.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        let (train, train_torn) = read_jsonl(&dir.join("train.jsonl"));
        let (events, events_torn) = read_jsonl(&dir.join("events.jsonl"));
        let (metrics, metrics_torn) = read_jsonl(&dir.join("metrics.jsonl"));
        let metrics: Vec<Window> = metrics
            .into_iter()
            .filter_map(|m| serde_json::from_value(m).ok())
            .collect();
        let mut torn = Vec::new();
        for (t, name) in [
            (train_torn, "train.jsonl"),
            (events_torn, "events.jsonl"),
            (metrics_torn, "metrics.jsonl"),
        ] {
            if t {
                torn.push(name);
            }
        }
        let steps = lineage_steps(&train);
        // The run's end: a run_end after its last start (a resumed session's is not the
        // end of the run).
        let last_start = events.iter().rposition(|e| e["event"] == "run_start");
        let ended = events
            .iter()
            .enumerate()
            .rev()
            .find(|(i, e)| e["event"] == "run_end" && last_start.is_none_or(|s| *i > s))
            .map(|(_, e)| e.clone());
        // One timeline over every session of the run: it starts at its earliest record
        // (after a --resume, state.json's start is the last session's).
        let t0 = state["started_at_unix_ms"]
            .as_f64()
            .into_iter()
            .chain(events.iter().filter_map(|e| ms_of(&e["time"])))
            .chain(metrics.iter().filter_map(|m| ms_of_str(&m.time)))
            .chain(train.iter().filter_map(|l| l["t"].as_f64()))
            .reduce(f64::min)
            .unwrap_or(0.0);
        let t1 = match ended.as_ref().and_then(|e| ms_of(&e["time"])) {
            Some(t) => t,
            None => events
                .iter()
                .filter_map(|e| ms_of(&e["time"]))
                .chain(metrics.iter().filter_map(|m| ms_of_str(&m.time)))
                .chain(train.iter().filter_map(|l| l["t"].as_f64()))
                .fold(t0, f64::max),
        };
        // The supervisor writes the report of its run after its run_end, still holding the lock.
        let live = ended.is_none()
            && crate::run::rundir::ExistingRun::open(Some(dir))
                .map(|r| r.supervisor_alive())
                .unwrap_or(false);
        Run {
            dir: dir.to_path_buf(),
            state,
            train,
            steps,
            events,
            metrics,
            torn,
            t0,
            t1: t1.max(t0 + 1.0),
            live,
            ended,
        }
    }

    /// Seconds since the start, of an RFC 3339 time.
    fn secs(&self, t: &Value) -> Option<f64> {
        ms_of(t).map(|ms| (ms - self.t0) / 1e3)
    }

    /// Seconds since the start, of a metrics window's end.
    fn window_secs(&self, m: &Window) -> Option<f64> {
        ms_of_str(&m.time).map(|ms| (ms - self.t0) / 1e3)
    }

    fn time_range(&self) -> (f64, f64) {
        (0.0, (self.t1 - self.t0) / 1e3)
    }

    /// (seconds since start, window) of each metrics window with `f`'s value.
    fn windows(&self, f: impl Fn(&Window) -> Option<f64>) -> Vec<(f64, f64)> {
        self.metrics
            .iter()
            .filter_map(|m| Some((self.window_secs(m)?, f(m).unwrap_or(f64::NAN))))
            .collect()
    }

    fn start_event(&self) -> Option<&Value> {
        self.events.iter().find(|e| e["event"] == "run_start")
    }

    /// Seconds since the start of each session after the first (each --resume's
    /// `run_start`), for the time charts' markers.
    fn resumes(&self) -> Vec<f64> {
        self.events
            .iter()
            .filter(|e| e["event"] == "run_start")
            .skip(1)
            .filter_map(|e| self.secs(&e["time"]))
            .collect()
    }

    /// Seconds since the start of each device that moved between the roles
    /// (`--targets auto`), labelled `from → to`.
    fn role_moves(&self) -> Vec<(f64, String)> {
        self.events
            .iter()
            .filter(|e| e["event"] == "role_move")
            .filter_map(|e| {
                let (from, to) = (e["from"].as_str()?, e["to"].as_str()?);
                Some((self.secs(&e["time"])?, format!("{from} → {to}")))
            })
            .collect()
    }
}

/// What the page leaves out, and why.
#[derive(Default)]
struct Absent(Vec<(String, String)>);

impl Absent {
    /// Note the absence; the paragraph to put where the plot would be.
    fn note(&mut self, series: &str, why: impl Into<String>) -> String {
        let why = why.into();
        let p = format!(
            r#"<p class="absent" data-series="{}">{}: not shown: {}</p>"#,
            esc(series),
            esc(series),
            esc(&why)
        );
        self.0.push((series.into(), why));
        p
    }
}

/// Why the run has no GPU samples.
fn why_no_gpu(run: &Run) -> String {
    if run.metrics.is_empty() {
        return "no metrics window written yet (metrics.jsonl is empty; the first is written after --metrics-interval)".into();
    }
    if run.start_event().is_some_and(|e| e["gpu_metrics"] == false) {
        return "no GPU samples: GPU metrics were turned off (--no-gpu-metrics)".into();
    }
    let workers = run.state["workers"].as_array().cloned().unwrap_or_default();
    if !workers.is_empty() && workers.iter().all(|w| w["gpu"] == "cpu") {
        return "no GPU samples: every worker ran on CPU (no NVIDIA GPU, or --gpus cpu:N)".into();
    }
    let log = std::fs::read_to_string(run.dir.join("supervisor.log")).unwrap_or_default();
    if let Some(l) = log.lines().find(|l| l.contains("GPU metrics are off")) {
        let why = l
            .split_once("GPU metrics are off")
            .map_or(l, |(_, w)| w)
            .trim_start_matches(':')
            .trim();
        return format!("no GPU samples: GPU metrics are off: {why}");
    }
    "no GPU samples in metrics.jsonl (NVML gave none)".into()
}

/// The summary table's rows: (class, label, shown, machine-readable value).
#[derive(Default)]
struct Rows(Vec<(&'static str, &'static str, String, String)>);

impl Rows {
    fn add(&mut self, class: &'static str, label: &'static str, shown: String, value: String) {
        self.0.push((class, label, shown, value));
    }
}

fn summary(run: &Run, tps: Option<(f64, f64, f64)>) -> String {
    let mut rows = Rows::default();
    quality_rows(run, &mut rows);
    identity_rows(run, &mut rows);
    progress_rows(run, tps, &mut rows);
    health_rows(run, &mut rows);
    outcome_rows(run, &mut rows);
    let mut h = String::from(r#"<table class="summary">"#);
    for (class, label, shown, value) in rows.0 {
        let _ = write!(
            h,
            r#"<tr><th>{}</th><td class="{class}" data-value="{}">{}</td></tr>"#,
            esc(label),
            esc(&value),
            esc(&shown)
        );
    }
    h.push_str("</table>");
    h
}

/// What the summary leads with, what the drafter is worth: the last real τ, the best
/// checkpoint and the last held-out eval.
fn quality_rows(run: &Run, rows: &mut Rows) {
    let taus = lineage_records(&run.train, "tau");
    // train.jsonl's last τ of the final lineage; else the one state.json holds.
    let tau = taus
        .last()
        .or(Some(&run.state["train"]["tau"]))
        .filter(|t| t["pooled"].is_number());
    match tau {
        Some(t) => {
            let (shown, value) = tau_cell(t);
            rows.add("tau", "τ (real acceptance length)", shown, value);
        }
        None => rows.add(
            "tau",
            "τ (real acceptance length)",
            "not measured (use --eval-prompts or dflash-supervise eval)".into(),
            String::new(),
        ),
    }
    let (shown, value) = best_cell(run, &taus);
    rows.add("best-checkpoint", "best checkpoint", shown, value);
    match lineage_evals(&run.train).last() {
        Some(e) => {
            let (loss, acc) = (
                e["loss"].as_f64().unwrap_or(f64::NAN),
                e["acceptance"].as_f64().unwrap_or(f64::NAN),
            );
            let step = e["step"].as_u64().map_or("?".into(), |s| s.to_string());
            rows.add(
                "eval",
                "held-out eval (last)",
                format!(
                    "loss {} · acceptance proxy {} · at step {step}",
                    fmt_value(loss),
                    fmt_value(acc)
                ),
                format!("{loss:e} {acc:e} {step}"),
            );
        }
        None => rows.add(
            "eval",
            "held-out eval (last)",
            "not measured (use --eval-data)".into(),
            String::new(),
        ),
    }
}

/// The τ row of the record `t`: shown, and its value (pooled, its interval, the step).
fn tau_cell(t: &Value) -> (String, String) {
    let num = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let ci = |k: &str| match (t[k][0].as_f64(), t[k][1].as_f64()) {
        (Some(lo), Some(hi)) => format!(" (95% CI {}–{})", fmt_value(lo), fmt_value(hi)),
        _ => String::new(),
    };
    let step = t["step"].as_u64().map_or("?".into(), |s| s.to_string());
    let mut shown = format!(
        "{} pooled{}",
        fmt_value(num(&t["pooled"])),
        ci("pooled_ci95")
    );
    if t["mean_of_means"].is_number() {
        let _ = write!(
            shown,
            " · {} mean of per-prompt means{}",
            fmt_value(num(&t["mean_of_means"])),
            ci("mean_of_means_ci95")
        );
    }
    let _ = write!(shown, " · at step {step}");
    if let Some(n) = t["prompts"].as_u64() {
        let _ = write!(shown, " over {n} prompts");
    }
    let value = format!(
        "{:e} {:e} {:e} {step}",
        num(&t["pooled"]),
        num(&t["pooled_ci95"][0]),
        num(&t["pooled_ci95"][1])
    );
    (shown, value)
}

/// The best checkpoint row: the step `checkpoints/best` names (else state.json's), with
/// the τ or the eval that made it the best; shown, and its value (the step).
fn best_cell(run: &Run, taus: &[Value]) -> (String, String) {
    let checkpoints = run.dir.join("checkpoints");
    let linked = crate::training::eval::best_step(&checkpoints);
    let Some(step) = linked.or(run.state["train"]["best_step"].as_u64()) else {
        return (
            "none: no τ (--eval-prompts) or held-out eval (--eval-data) to pick it by".into(),
            String::new(),
        );
    };
    let at = |v: &Value| v["step"].as_u64() == Some(step);
    let why = match (
        taus.iter().rev().find(|t| at(t)),
        lineage_evals(&run.train).into_iter().rev().find(at),
    ) {
        (Some(t), _) => format!(
            ", pooled τ {}",
            fmt_value(t["pooled"].as_f64().unwrap_or(f64::NAN))
        ),
        (None, Some(e)) => format!(
            ", held-out eval acceptance {}",
            fmt_value(e["acceptance"].as_f64().unwrap_or(f64::NAN))
        ),
        _ => String::new(),
    };
    let place = if linked.is_none() {
        " (state.json; no checkpoints/best link)"
    } else if crate::training::eval::dangling_best(&checkpoints).is_some() {
        " (checkpoints/best; its checkpoint is gone)"
    } else {
        " (checkpoints/best)"
    };
    (format!("step {step}{place}{why}"), step.to_string())
}

/// Which run, when, for how long, and how it ended.
fn identity_rows(run: &Run, rows: &mut Rows) {
    let st = &run.state;
    let id = run
        .dir
        .file_name()
        .map_or(run.dir.display().to_string(), |n| {
            n.to_string_lossy().into_owned()
        });
    rows.add("run-id", "run", format!("{id} ({})", run.dir.display()), id);
    let started = st["started_at"].as_str().unwrap_or("?").to_string();
    // A resumed run: when it first started, and when this session did.
    let resumes = run.resumes().len();
    let shown = if resumes > 0 {
        let first = humantime::format_rfc3339_millis(
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(run.t0.max(0.0) as u64),
        );
        format!("{first} (resumed {resumes}×, the last session at {started})")
    } else {
        started.clone()
    };
    rows.add("started", "started", shown, started);
    let dur = (run.t1 - run.t0) / 1e3;
    let so_far = if run.ended.is_some() { "" } else { " (so far)" };
    rows.add(
        "duration",
        "duration",
        format!("{}{so_far}", fmt_dur(dur)),
        format!("{dur:.3}"),
    );
    let (ended, code) = match &run.ended {
        Some(e) => (
            format!(
                "ended: {} (exit code {})",
                e["reason"].as_str().unwrap_or("?"),
                e["exit_code"]
            ),
            e["exit_code"].to_string(),
        ),
        None if run.live => (
            "still running (a supervisor holds the run's lock): a snapshot of now".into(),
            "null".into(),
        ),
        None => (
            "did not end cleanly (no run_end event: the supervisor was killed or crashed)".into(),
            "null".into(),
        ),
    };
    rows.add(
        "ended",
        "exit status and reason",
        format!("{ended}; state {}", st["phase"].as_str().unwrap_or("?")),
        code,
    );
}

/// How far it got: steps, batches, tokens and their rate.
fn progress_rows(run: &Run, tps: Option<(f64, f64, f64)>, rows: &mut Rows) {
    let st = &run.state;
    let last = run.steps.last();
    let steps = last.and_then(|l| l["step"].as_u64()).unwrap_or(0);
    rows.add("steps", "steps", steps.to_string(), steps.to_string());
    let consumed = st["batches_consumed"].as_u64().unwrap_or(0);
    rows.add(
        "batches",
        "batches",
        format!(
            "{consumed} consumed of {} loaded",
            st["batches_produced"].as_u64().unwrap_or(0)
        ),
        consumed.to_string(),
    );
    let tokens: u64 = run.steps.iter().filter_map(|s| s["tokens"].as_u64()).sum();
    rows.add(
        "tokens",
        "tokens trained",
        fmt_num(tokens as f64),
        tokens.to_string(),
    );
    match tps {
        Some((m, p10, p90)) => rows.add(
            "tokens-per-s",
            "trained tokens/s (over metrics windows)",
            format!(
                "mean {} · p10 {} · p90 {}",
                fmt_num(m),
                fmt_num(p10),
                fmt_num(p90)
            ),
            format!("{m:.3} {p10:.3} {p90:.3}"),
        ),
        None => rows.add(
            "tokens-per-s",
            "trained tokens/s",
            "– (no metrics window yet)".into(),
            String::new(),
        ),
    }
}

/// What went wrong on the way: restarts, rollbacks, skipped steps, bad lines; and the
/// checkpoints written.
fn health_rows(run: &Run, rows: &mut Rows) {
    let st = &run.state;
    let workers = st["workers"].as_array().cloned().unwrap_or_default();
    rows.add(
        "restarts",
        "restarts per worker",
        workers
            .iter()
            .map(|w| format!("{} {}", w["name"].as_str().unwrap_or("?"), w["restarts"]))
            .collect::<Vec<_>>()
            .join(", "),
        workers
            .iter()
            .map(|w| format!("{}={}", w["name"].as_str().unwrap_or("?"), w["restarts"]))
            .collect::<Vec<_>>()
            .join(","),
    );
    let rollbacks = run
        .train
        .iter()
        .filter(|l| l["rollback"]["from"].is_u64())
        .count();
    rows.add(
        "rollbacks",
        "rollbacks",
        rollbacks.to_string(),
        rollbacks.to_string(),
    );
    let skipped = st["train"]["skipped_steps"].as_u64().unwrap_or(0);
    rows.add(
        "skipped-steps",
        "skipped steps",
        skipped.to_string(),
        skipped.to_string(),
    );
    let ckpts = run
        .events
        .iter()
        .filter(|e| e["event"] == "checkpoint")
        .count();
    rows.add(
        "checkpoints",
        "checkpoints written",
        ckpts.to_string(),
        ckpts.to_string(),
    );
    match st["bad_lines"].as_u64() {
        Some(n) => rows.add("bad-lines", "bad data lines", n.to_string(), n.to_string()),
        None => rows.add(
            "bad-lines",
            "bad data lines",
            "– (not recorded in state.json)".into(),
            String::new(),
        ),
    }
}

/// What came out: the final loss and acceptance, the ledger's audit, the export.
fn outcome_rows(run: &Run, rows: &mut Rows) {
    let st = &run.state;
    let last = run.steps.last();
    let audit = crate::data::ledger::audit(&run.dir.join(crate::data::ledger::LEDGER_FILE)).ok();
    let (loss, acc) = last.map_or((f64::NAN, f64::NAN), |l| {
        (
            l["loss"].as_f64().unwrap_or(f64::NAN),
            l["acceptance"].as_f64().unwrap_or(f64::NAN),
        )
    });
    rows.add(
        "final-loss",
        "final loss",
        if loss.is_finite() {
            format!("{loss:.4}")
        } else {
            "–".into()
        },
        format!("{loss:e}"),
    );
    rows.add(
        "final-acceptance",
        "final acceptance proxy",
        if acc.is_finite() {
            format!("{acc:.3}")
        } else {
            "–".into()
        },
        format!("{acc:e}"),
    );
    match &audit {
        Some(a) => rows.add(
            "ledger",
            "ledger audit",
            format!(
                "{} produced, {} consumed once, {} lost, {} duplicated, {} in flight, {} loaded ahead{}",
                a.produced,
                a.consumed_once,
                a.lost,
                a.duplicated,
                a.in_flight,
                a.loaded_ahead,
                if a.lost == 0 && a.duplicated == 0 {
                    " (ok)"
                } else {
                    " (FAILED)"
                }
            ),
            format!(
                "{} {} {} {} {}",
                a.produced, a.consumed_once, a.lost, a.duplicated, a.in_flight
            ),
        ),
        None => rows.add("ledger", "ledger audit", "unreadable".into(), String::new()),
    }
    if let Some(d) = st["train"]["exported"].as_str() {
        rows.add(
            "exported",
            "drafter exported to",
            d.to_string(),
            d.to_string(),
        );
    }
}

/// The settings as the run used them (run.json's `resolved`: defaults included), one row
/// per setting, nested ones named by their path (`drafter.block_size`).
fn settings(dir: &Path) -> String {
    let resolved = std::fs::read_to_string(dir.join(crate::training::resume::RUN_FILE))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .map(|v| v["resolved"].clone())
        .filter(|v| v.is_object());
    let Some(resolved) = resolved else {
        return r#"<h2>Settings</h2><p class="absent">run.json holds no resolved settings (a run of an older version)</p>"#.into();
    };
    fn flatten(prefix: &str, v: &Value, out: &mut Vec<(String, String)>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    flatten(&key, x, out);
                }
            }
            Value::String(s) => out.push((prefix.into(), s.clone())),
            Value::Null => out.push((prefix.into(), "-".into())),
            other => out.push((prefix.into(), other.to_string())),
        }
    }
    let mut rows = Vec::new();
    flatten("", &resolved, &mut rows);
    // Folded: a long table, below which the plots would start a few screens down.
    let mut h = format!(
        r#"<h2>Settings</h2><details><summary>{} settings as the run used them, defaults included (run.json, "resolved")</summary><table class="settings">"#,
        rows.len()
    );
    for (k, v) in rows {
        let _ = write!(
            h,
            r#"<tr><th>{}</th><td data-key="{}">{}</td></tr>"#,
            esc(&k),
            esc(&k),
            esc(&v)
        );
    }
    h.push_str("</table></details>");
    h
}

/// The step axis of the training charts: each step line's step, and the range to show.
fn step_axis(steps: &[Value]) -> (Vec<f64>, (f64, f64)) {
    let xs: Vec<f64> = steps
        .iter()
        .map(|l| l["step"].as_f64().unwrap_or(0.0))
        .collect();
    let x = (
        xs.iter().copied().fold(f64::INFINITY, f64::min),
        xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    (xs, x)
}

/// The value `k` of each step line, at its step (`xs`): NaN where a line has none.
fn step_series(steps: &[Value], xs: &[f64], k: &str) -> Vec<(f64, f64)> {
    steps
        .iter()
        .zip(xs)
        .map(|(l, x)| (*x, l[k].as_f64().unwrap_or(f64::NAN)))
        .collect()
}

/// The value `k` of each held-out eval, at its step.
fn eval_series(evals: &[Value], k: &str) -> Vec<(f64, f64)> {
    evals
        .iter()
        .map(|e| {
            (
                e["step"].as_f64().unwrap_or(f64::NAN),
                e[k].as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect()
}

/// The rollbacks of train.jsonl: (from step, to step).
fn rollbacks_of(run: &Run) -> Vec<(u64, u64)> {
    run.train
        .iter()
        .filter_map(|l| {
            Some((
                l["rollback"]["from"].as_u64()?,
                l["rollback"]["to"].as_u64()?,
            ))
        })
        .collect()
}

/// A dotted vertical line per rollback, at the step it went back to.
fn rollback_marks(rollbacks: &[(u64, u64)], f: &Frame) -> String {
    let mut s = String::new();
    for (from, to) in rollbacks {
        let _ = write!(
            s,
            r##"<line class="rollback" data-from="{from}" data-to="{to}" x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#34495e" stroke-dasharray="2 2"><title>rollback from step {from} to step {to}</title></line>"##,
            f.top,
            f.bottom,
            x = f.px(*to as f64)
        );
    }
    s
}

fn training(run: &Run, absent: &mut Absent) -> String {
    let steps = &run.steps;
    if steps.is_empty() {
        return absent.note("loss and acceptance", "no training step was committed");
    }
    let (xs, x) = step_axis(steps);
    let rollbacks = rollbacks_of(run);
    // Held-out evals (--eval-data) beside the training curves, at their steps.
    let evals = lineage_evals(&run.train);
    let mut out = loss_chart(steps, &xs, x, &evals, &rollbacks);
    let (acceptance, slots) = acceptance_chart(steps, &xs, x, &evals, &rollbacks);
    out.push_str(&acceptance);
    if slots == 0 {
        out.push_str(&absent.note("per-slot accuracy", "train.jsonl has no slot_accuracy"));
    }
    // Real τ (--eval-prompts), measured by decoding.
    let taus = lineage_records(&run.train, "tau");
    if let Some(last) = taus.last() {
        out.push_str(&tau_chart(x, &taus, &rollbacks));
        out.push_str(&tau_breakdown(&run.dir, last));
    }
    out
}

/// The worker's whole report of the τ measured at `step` (RUN_DIR/eval/tau-step-N.json,
/// its last line), if it is there.
fn tau_report(dir: &Path, step: u64) -> Option<Value> {
    let path = dir.join("eval").join(format!("tau-step-{step:08}.json"));
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().rev().find(|l| !l.trim().is_empty())?;
    serde_json::from_str(line).ok()
}

/// The last τ measurement (`last`, its train.jsonl record) beyond its τ, from the worker's
/// report of it: τ per category of its prompts (a table, when they had categories) and
/// its acceptance curve (a chart, overall and per category). Nothing when the report is
/// not there (a measurement of an older version records no curve).
fn tau_breakdown(dir: &Path, last: &Value) -> String {
    let Some(step) = last["step"].as_u64() else {
        return String::new();
    };
    let Some(r) = tau_report(dir, step) else {
        return String::new();
    };
    let cats: Vec<(&String, &Value)> = r["per_category"]
        .as_object()
        .map(|o| o.iter().collect())
        .unwrap_or_default();
    let mut out = String::new();
    if !cats.is_empty() {
        out.push_str(&category_table(step, &r, &cats));
    }
    out.push_str(&acceptance_curve(step, &r, &cats));
    out
}

/// One row of the per-category table: the name, the prompts, both τ with their intervals.
fn category_row(class: &str, name: &str, prompts: &Value, t: &Value) -> String {
    let num = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let with_ci = |k: &str| {
        format!(
            "{:.3} [{:.2}, {:.2}]",
            num(&t[k]),
            num(&t[format!("{k}_ci95")][0]),
            num(&t[format!("{k}_ci95")][1])
        )
    };
    format!(
        r#"<tr class="{class}" data-category="{}" data-prompts="{}" data-pooled="{:e}" data-tokens="{}" data-verify-steps="{}" data-mean-of-means="{:e}"><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
        esc(name),
        prompts.as_u64().unwrap_or(0),
        num(&t["pooled"]),
        t["tokens"].as_u64().unwrap_or(0),
        t["verify_steps"].as_u64().unwrap_or(0),
        num(&t["mean_of_means"]),
        esc(name),
        prompts.as_u64().unwrap_or(0),
        esc(&with_ci("mean_of_means")),
        esc(&with_ci("pooled"))
    )
}

/// τ per category of the measurement of `step` (`r`, the worker's report), then all
/// prompts together.
fn category_table(step: u64, r: &Value, cats: &[(&String, &Value)]) -> String {
    let mut h = format!(
        r#"<h3>τ per prompt category at step {step} (the last τ measurement)</h3><table class="tau-categories" data-step="{step}"><tr><th>category</th><th>prompts</th><th>τ mean of per-prompt means [95% CI]</th><th>τ pooled [95% CI]</th></tr>"#
    );
    for (name, c) in cats {
        h.push_str(&category_row(
            "tau-category",
            name,
            &c["prompts"],
            &c["tau"],
        ));
    }
    h.push_str(&category_row(
        "tau-category-all",
        "all prompts",
        &r["prompts"],
        &r["tau"],
    ));
    h.push_str("</table>");
    h
}

/// The acceptance curve of the measurement of `step`: for each drafted position of the
/// block, the share of verify steps that accepted its token, for all prompts and each
/// category.
fn acceptance_curve(step: u64, r: &Value, cats: &[(&String, &Value)]) -> String {
    let curve = |v: &Value| -> Vec<(f64, f64)> {
        v.as_array()
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(i, f)| ((i + 1) as f64, f.as_f64().unwrap_or(f64::NAN)))
            .collect()
    };
    let all = curve(&r["acceptance_by_position"]);
    if all.is_empty() {
        return String::new();
    }
    let mut c = Chart::new(
        "tau-acceptance",
        format!("Acceptance by drafted position at step {step}: share of verify steps accepting its token"),
        XAxis::Positions,
        (1.0, all.len() as f64),
        "accepted share",
    );
    c.yl = Some((-0.05, 1.05));
    c.series.push(
        Series::new("all prompts", "tau-acceptance", "#8e44ad", all)
            .dots()
            .unlabelled(),
    );
    for (i, (name, cat)) in cats.iter().enumerate() {
        c.series.push(
            Series::new(
                name.as_str(),
                "tau-acceptance-category",
                PALETTE[i % PALETTE.len()],
                curve(&cat["acceptance_by_position"]),
            )
            .attrs(format!(r#" data-category="{}""#, esc(name)))
            .dots()
            .unlabelled(),
        );
    }
    c.render(&|_: &Frame| String::new())
}

/// The real acceptance length τ at each measured step, both definitions, with the 95%
/// interval of each (dashed, and a bar at each point); the last pooled τ is written
/// beside its point.
fn tau_chart(x: (f64, f64), taus: &[Value], rollbacks: &[(u64, u64)]) -> String {
    let mut c = Chart::new(
        "tau",
        "Real acceptance length τ (speculative decoding of --eval-prompts), 95% intervals dashed",
        XAxis::Steps,
        x,
        "τ",
    );
    let bound = |k: &str, i: usize| -> Vec<(f64, f64)> {
        taus.iter()
            .map(|t| {
                (
                    t["step"].as_f64().unwrap_or(f64::NAN),
                    t[k][i].as_f64().unwrap_or(f64::NAN),
                )
            })
            .collect()
    };
    for (name, class, key, color) in [
        ("τ pooled", "tau-pooled", "pooled", "#8e44ad"),
        (
            "τ mean of per-prompt means",
            "tau-mean",
            "mean_of_means",
            "#27ae60",
        ),
    ] {
        let s = Series::new(name, class, color, eval_series(taus, key)).dots();
        // The pooled τ's value is written; the other's, beside it, would cover it.
        c.series.push(if key == "pooled" {
            s.label_last()
        } else {
            s.unlabelled()
        });
        let ci = format!("{key}_ci95");
        for (i, side) in [(0, "low"), (1, "high")] {
            c.series.push(
                Series::new(
                    format!("{name}, 95% {side}"),
                    &format!("{class}-ci"),
                    color,
                    bound(&ci, i),
                )
                .dash("3 3"),
            );
        }
    }
    c.render(&|f: &Frame| {
        let mut s = rollback_marks(rollbacks, f);
        s.push_str(&ci_bars(taus, f));
        s
    })
}

/// A vertical bar over each τ's 95% interval, capped at both ends (the pooled one left
/// of the step, the mean of means right of it).
fn ci_bars(taus: &[Value], f: &Frame) -> String {
    let mut s = String::new();
    for t in taus {
        let Some(step) = t["step"].as_f64() else {
            continue;
        };
        for (key, class, color, dx) in [
            ("pooled_ci95", "tau-pooled-ci-bar", "#8e44ad", -3.0),
            ("mean_of_means_ci95", "tau-mean-ci-bar", "#27ae60", 3.0),
        ] {
            let (Some(lo), Some(hi)) = (t[key][0].as_f64(), t[key][1].as_f64()) else {
                continue;
            };
            let (x, a, b) = (f.px(step) + dx, f.py(lo), f.py(hi));
            let _ = write!(
                s,
                r#"<path class="{class}" data-step="{step}" data-low="{lo:.6e}" data-high="{hi:.6e}" d="M{x:.1} {a:.1} V{b:.1} M{:.1} {a:.1} H{:.1} M{:.1} {b:.1} H{:.1}" stroke="{color}" stroke-width="1.2" fill="none"/>"#,
                x - 2.5,
                x + 2.5,
                x - 2.5,
                x + 2.5
            );
        }
    }
    s
}

/// The loss per step (and per held-out eval), the learning rate on the right axis.
fn loss_chart(
    steps: &[Value],
    xs: &[f64],
    x: (f64, f64),
    evals: &[Value],
    rollbacks: &[(u64, u64)],
) -> String {
    let lr = step_series(steps, xs, "lr");
    let mut c = Chart::new(
        "loss",
        "Loss per step, learning rate on the right axis",
        XAxis::Steps,
        x,
        "loss",
    );
    let loss = step_series(steps, xs, "loss");
    // Beside the raw loss, its exponential moving average (over about 2% of the steps, at
    // least 10), which reads through a noisy curve.
    let smooth = ema(&loss, (steps.len() as f64 / 50.0).max(10.0));
    c.series
        .push(Series::new("loss", "loss", "#e8a49c", loss).dots());
    c.series
        .push(Series::new("loss (EMA)", "loss-ema", "#c0392b", smooth));
    if !evals.is_empty() {
        c.series.push(
            Series::new(
                "eval loss",
                "eval-loss",
                "#e67e22",
                eval_series(evals, "loss"),
            )
            .dash("6 2")
            .dots(),
        );
    }
    if lr.iter().any(|p| p.1.is_finite()) {
        c.y_right = Some(("learning rate".into(), fit(lr.iter().map(|p| p.1))));
        c.series.push(
            Series::new("learning rate", "lr", "#7d7d7d", lr)
                .right()
                .dash("4 3"),
        );
    }
    if !rollbacks.is_empty() {
        c.legend_extra.push((
            "#34495e".into(),
            "rollback (dotted: steps after it were trained again)".into(),
        ));
    }
    c.render(&|f: &Frame| rollback_marks(rollbacks, f))
}

/// The exponential moving average of `pts` with a span of `n` points (α = 2 / (n + 1)),
/// bias-corrected at the start as TensorBoard's smoothing is; a missing value is skipped.
fn ema(pts: &[(f64, f64)], n: f64) -> Vec<(f64, f64)> {
    let a = 2.0 / (n + 1.0);
    let (mut m, mut w) = (0.0, 0.0);
    pts.iter()
        .map(|&(x, y)| {
            if y.is_finite() {
                m = (1.0 - a) * m + a * y;
                w = (1.0 - a) * w + a;
            }
            (x, if w > 0.0 { m / w } else { f64::NAN })
        })
        .collect()
}

/// The acceptance proxy per step (and per held-out eval), the per-slot accuracy on the
/// right axis; and how many slots that has (0: none recorded).
fn acceptance_chart(
    steps: &[Value],
    xs: &[f64],
    x: (f64, f64),
    evals: &[Value],
    rollbacks: &[(u64, u64)],
) -> (String, usize) {
    let mut c = Chart::new(
        "acceptance",
        "Acceptance length proxy per step, per-slot accuracy on the right axis",
        XAxis::Steps,
        x,
        "acceptance",
    );
    c.series.push(
        Series::new(
            "acceptance",
            "acceptance",
            "#1f4e9c",
            step_series(steps, xs, "acceptance"),
        )
        .dots(),
    );
    if !evals.is_empty() {
        c.series.push(
            Series::new(
                "eval acceptance",
                "eval-acceptance",
                "#16a085",
                eval_series(evals, "acceptance"),
            )
            .dash("6 2")
            .dots(),
        );
    }
    let slots = steps
        .iter()
        .filter_map(|l| l["slot_accuracy"].as_array().map(|a| a.len()))
        .max()
        .unwrap_or(0);
    if slots > 0 {
        c.y_right = Some(("per-slot accuracy".into(), (0.0, 1.0)));
        for i in 0..slots {
            let pts = steps
                .iter()
                .zip(xs)
                .map(|(l, x)| (*x, l["slot_accuracy"][i].as_f64().unwrap_or(f64::NAN)))
                .collect();
            // Slot 1 (the first drafted token) darkest.
            let shade = 30 + (i * 170 / slots.max(1)) as u32;
            let color = format!("rgb({shade},{},{})", 120 + shade / 2, 80 + shade / 3);
            c.series.push(
                Series::new(format!("slot {}", i + 1), "slot-accuracy", &color, pts)
                    .attrs(format!(r#" data-slot="{}""#, i + 1))
                    .right(),
            );
        }
    }
    (c.render(&|f: &Frame| rollback_marks(rollbacks, f)), slots)
}

fn throughput(run: &Run, absent: &mut Absent) -> String {
    if run.metrics.is_empty() {
        return absent.note("tokens/s", why_no_metrics(run));
    }
    let mut c = Chart::new(
        "tokens-per-s",
        "Tokens/s: trained in total, and per worker (targets: tokens processed)",
        XAxis::Time,
        run.time_range(),
        "tokens/s",
    )
    .marks(&run.resumes(), "resumed")
    .more_marks(run.role_moves());
    c.series.push(Series::new(
        "trained, total",
        "tps-total",
        "#111",
        run.windows(|m| Some(m.pipeline.tokens_per_s_trained)),
    ));
    let workers: BTreeSet<String> = run
        .metrics
        .iter()
        .flat_map(|m| m.pipeline.tokens_per_s_by_worker.keys().cloned())
        .collect();
    for (i, w) in workers.iter().enumerate() {
        let pts = run.windows(|m| m.pipeline.tokens_per_s_by_worker.get(w).copied());
        let s = Series::new(w.clone(), "tps-worker", PALETTE[i % PALETTE.len()], pts)
            .attrs(format!(r#" data-worker="{}""#, esc(w)));
        c.series.push(if w.starts_with("target") {
            s.dash("5 3")
        } else {
            s
        });
    }
    c.render(&|_| String::new())
}

/// A job across nodes: each node's windows as the leader's metrics.jsonl holds them (its
/// own, and under `nodes` the latest of every other node at each of its windows; one
/// window of a node counted once).
fn node_windows(run: &Run) -> BTreeMap<u32, Vec<&Window>> {
    let mut by: BTreeMap<u32, Vec<&Window>> = BTreeMap::new();
    for m in &run.metrics {
        if let Some(n) = m.node {
            by.entry(n).or_default().push(m);
        }
        for (n, w) in &m.nodes {
            let seen = by.entry(*n).or_default();
            if seen.last().is_none_or(|l| l.time != w.time) {
                seen.push(w);
            }
        }
    }
    by
}

/// A job across nodes: per node, its GPUs (sampled by its own supervisor), how busy they
/// were, the tokens/s it trained and its restarts; `None` for a run of one node.
fn nodes(run: &Run) -> Option<String> {
    let by = node_windows(run);
    if by.is_empty() {
        return None;
    }
    let mut h = String::from(
        r#"<table class="nodes"><tr><th>node</th><th>windows</th><th>GPUs</th><th>GPU busy (mean)</th><th>tokens/s trained (mean)</th><th>restarts</th></tr>"#,
    );
    for (node, ws) in &by {
        let gpus = ws.iter().map(|w| w.gpu.gpus.len()).max().unwrap_or(0);
        let busy: Vec<f64> = ws
            .iter()
            .flat_map(|w| w.gpu.gpus.iter())
            .filter_map(|g| g.stat("util_gpu_pct", Agg::Mean))
            .collect();
        let busy = match busy.is_empty() {
            true => "—".to_string(),
            false => format!("{:.0}%", busy.iter().sum::<f64>() / busy.len() as f64),
        };
        let tps = ws
            .iter()
            .map(|w| w.pipeline.tokens_per_s_trained)
            .sum::<f64>()
            / ws.len() as f64;
        let restarts = ws.last().map_or(0, |w| w.restarts);
        let _ = write!(
            h,
            r#"<tr data-node="{node}"><td>{node}{}</td><td>{}</td><td>{gpus}</td><td>{busy}</td><td>{}</td><td>{restarts}</td></tr>"#,
            if *node == 0 { " (leader)" } else { "" },
            ws.len(),
            fmt_num(tps)
        );
    }
    h.push_str("</table>");
    h.push_str(r#"<p class="note">Each node's supervisor samples its own GPUs (NVML) and sends its windows to the leader; the charts above are the leader's node.</p>"#);
    Some(h)
}

fn why_no_metrics(run: &Run) -> String {
    if run.live {
        "no metrics window written yet (the first is written after --metrics-interval)".into()
    } else {
        "metrics.jsonl is empty or missing (the run ended before its first metrics window)".into()
    }
}

/// The GPU indices the metrics windows report, and how many samples they hold.
fn gpu_indices(run: &Run) -> (u64, Vec<u64>) {
    let samples: u64 = run.metrics.iter().map(|m| m.gpu.samples as u64).sum();
    let indices: Vec<u64> = run
        .metrics
        .iter()
        .flat_map(|m| m.gpu.gpus.iter().map(|g| g.index as u64))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    (samples, indices)
}

/// GPU `idx`'s entry in the metrics window `m` (`None` when it has none).
fn gpu_of(m: &Window, idx: u64) -> Option<&Gpu> {
    m.gpu.gpus.iter().find(|g| g.index as u64 == idx)
}

/// A metrics window in which a GPU was throttled: the GPU, the window's end (seconds), its
/// length, and the reasons.
struct Throttle {
    gpu: u64,
    t: f64,
    window: f64,
    reasons: String,
}

/// An XID error: the GPU, the end of the window it came in (seconds), its code.
struct Xid {
    gpu: u64,
    t: f64,
    code: u64,
}

/// The throttles and XID errors of the GPUs `indices` over the run's metrics windows.
fn gpu_events(run: &Run, indices: &[u64]) -> (Vec<Throttle>, Vec<Xid>) {
    let (mut throttles, mut xids) = (Vec::new(), Vec::new());
    for m in &run.metrics {
        let Some(t) = run.window_secs(m) else {
            continue;
        };
        for &gpu in indices {
            let Some(g) = gpu_of(m, gpu) else {
                continue;
            };
            let reasons: Vec<&str> = g
                .throttle_reasons
                .iter()
                .flatten()
                .map(String::as_str)
                .collect();
            if !reasons.is_empty() {
                throttles.push(Throttle {
                    gpu,
                    t,
                    window: m.window_s,
                    reasons: reasons.join(", "),
                });
            }
            xids.extend(g.xid_errors.iter().map(|&code| Xid { gpu, t, code }));
        }
    }
    (throttles, xids)
}

/// A line of a GPU panel: (metric, stat, class, dashed, scale, label).
type GpuLine = (&'static str, Agg, &'static str, bool, f64, &'static str);

/// A GPU panel: (id, title, unit, its lines, fixed range).
type GpuPanel = (
    &'static str,
    &'static str,
    &'static str,
    Vec<GpuLine>,
    Option<(f64, f64)>,
);

/// The GPU panels: utilisation, memory, power, temperature, SM clock.
fn gpu_panels() -> [GpuPanel; 5] {
    let gib = 1073741824.0;
    [
        (
            "util",
            "GPU utilisation (mean of the window)",
            "%",
            vec![("util_gpu_pct", Agg::Mean, "gpu-util", false, 1.0, "")],
            Some((0.0, 100.0)),
        ),
        (
            "mem",
            "GPU memory used (max of the window), dashed: total",
            "GiB",
            vec![
                (
                    "mem_used_bytes",
                    Agg::Max,
                    "gpu-mem-used",
                    false,
                    1.0 / gib,
                    "",
                ),
                (
                    "mem_total_bytes",
                    Agg::Max,
                    "gpu-mem-total",
                    true,
                    1.0 / gib,
                    " total",
                ),
            ],
            None,
        ),
        (
            "power",
            "GPU power (mean of the window), dashed: its limit",
            "W",
            vec![
                ("power_w", Agg::Mean, "gpu-power", false, 1.0, ""),
                (
                    "power_limit_w",
                    Agg::Max,
                    "gpu-power-limit",
                    true,
                    1.0,
                    " limit",
                ),
            ],
            None,
        ),
        (
            "temp",
            "GPU temperature (max of the window)",
            "°C",
            vec![("temp_c", Agg::Max, "gpu-temp", false, 1.0, "")],
            None,
        ),
        (
            "sm-clock",
            "SM clock (mean of the window)",
            "MHz",
            vec![("sm_clock_mhz", Agg::Mean, "gpu-sm-clock", false, 1.0, "")],
            None,
        ),
    ]
}

/// A vertical line per XID error across a chart's plot.
fn xid_lines(xids: &[Xid], f: &Frame) -> String {
    let mut s = String::new();
    for Xid { gpu, t, code } in xids {
        let _ = write!(
            s,
            r##"<line class="xid-line" x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#c0392b" stroke-width="1.5" stroke-dasharray="3 2"><title>GPU {gpu}: XID {code} in the window ending at {}</title></line>"##,
            f.top,
            f.bottom,
            fmt_dur(*t),
            x = f.px(*t)
        );
    }
    s
}

/// One GPU panel's chart, a line (or two) per GPU, with the XIDs marked; a GPU NVML did
/// not report the metric of is noted in `absent`.
fn gpu_panel(
    run: &Run,
    absent: &mut Absent,
    indices: &[u64],
    xids: &[Xid],
    (id, title, unit, lines, yl): GpuPanel,
) -> String {
    // No red: that is the XIDs'.
    const GPU_COLORS: [&str; 9] = [
        "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
        "#333333",
    ];
    let mut out = String::new();
    let mut c = Chart::new(
        &format!("gpu-{id}"),
        title,
        XAxis::Time,
        run.time_range(),
        unit,
    )
    .marks(&run.resumes(), "resumed");
    c.plot_h = 110.0;
    let mut missing: Vec<u64> = Vec::new();
    for (gi, &idx) in indices.iter().enumerate() {
        for &(metric, stat, class, dashed, scale, label) in &lines {
            let pts = run.windows(|m| Some(gpu_of(m, idx)?.stat(metric, stat)? * scale));
            if !pts.iter().any(|p| p.1.is_finite()) {
                if !dashed {
                    missing.push(idx);
                }
                continue;
            }
            let name = if dashed {
                String::new()
            } else {
                format!("GPU {idx}{label}")
            };
            let color = GPU_COLORS[gi % GPU_COLORS.len()];
            let s = Series::new(name, class, color, pts).attrs(format!(r#" data-gpu="{idx}""#));
            c.series.push(if dashed { s.dash("6 3") } else { s });
        }
    }
    if !missing.is_empty() {
        let which = missing
            .iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        out.push_str(&absent.note(&format!("{title} of GPU {which}"), "NVML did not report it"));
    }
    if c.series.is_empty() {
        return out;
    }
    c.yl = yl.or_else(|| Some(fit(c.series.iter().flat_map(|s| s.pts.iter().map(|p| p.1)))));
    if !xids.is_empty() {
        c.legend_extra.push(("#c0392b".into(), "XID error".into()));
    }
    out.push_str(&c.render(&|f: &Frame| xid_lines(xids, f)));
    out
}

/// One lane per GPU: the windows with a throttle reason, and the XIDs.
fn gpu_event_lanes(run: &Run, indices: &[u64], throttles: &[Throttle], xids: &[Xid]) -> String {
    let row_h = 20.0;
    let mut c = Chart::new(
        "gpu-events",
        "Throttle reasons and XID errors per GPU",
        XAxis::Time,
        run.time_range(),
        "",
    )
    .marks(&run.resumes(), "resumed")
    .lanes(
        &indices
            .iter()
            .map(|i| format!("GPU {i}"))
            .collect::<Vec<_>>(),
        row_h,
    );
    c.legend_extra.push((
        "#e67e22".into(),
        "a throttle (clock-event) reason in the window".into(),
    ));
    c.legend_extra.push(("#c0392b".into(), "XID error".into()));
    c.render(&|f: &Frame| {
        let mut s = String::new();
        for (i, idx) in indices.iter().enumerate() {
            let y = f.top + row_h * i as f64;
            for Throttle { t, window: w, reasons: what, .. } in throttles.iter().filter(|x| x.gpu == *idx) {
                let (a, b) = (f.px((t - w).max(0.0)), f.px(*t));
                let _ = write!(
                    s,
                    r##"<rect class="throttle" data-gpu="{idx}" data-t="{t:.3}" data-reasons="{}" x="{a:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="#e67e22" fill-opacity="0.75"><title>GPU {idx} throttled ({}) in the window ending at {}</title></rect>"##,
                    esc(what),
                    y + 3.0,
                    (b - a).max(2.0),
                    row_h - 6.0,
                    esc(what),
                    fmt_dur(*t)
                );
            }
            for Xid { t, code, .. } in xids.iter().filter(|x| x.gpu == *idx) {
                let (x, yc) = (f.px(*t), y + row_h / 2.0);
                let _ = write!(
                    s,
                    r##"<path class="xid" data-gpu="{idx}" data-code="{code}" data-t="{t:.3}" d="M{x:.1} {:.1} L{:.1} {yc:.1} L{x:.1} {:.1} L{:.1} {yc:.1} Z" fill="#c0392b"><title>GPU {idx}: XID {code} in the window ending at {}</title></path>"##,
                    yc - 7.0,
                    x + 7.0,
                    yc + 7.0,
                    x - 7.0,
                    fmt_dur(*t)
                );
            }
        }
        s
    })
}

/// The throttle reasons and XID errors seen, in a sentence.
fn gpu_events_seen(throttles: &[Throttle], xids: &[Xid]) -> String {
    let kinds: BTreeSet<&str> = throttles
        .iter()
        .flat_map(|t| t.reasons.split(", "))
        .collect();
    format!(
        "<p>Throttle reasons seen: {}. XID errors: {}.</p>",
        if kinds.is_empty() {
            "none".to_string()
        } else {
            esc(&kinds.into_iter().collect::<Vec<_>>().join(", "))
        },
        if xids.is_empty() {
            "none".to_string()
        } else {
            esc(&xids
                .iter()
                .map(|x| format!("GPU {} XID {} at {}", x.gpu, x.code, fmt_dur(x.t)))
                .collect::<Vec<_>>()
                .join(", "))
        }
    )
}

fn gpus(run: &Run, absent: &mut Absent) -> String {
    let (samples, indices) = gpu_indices(run);
    if samples == 0 || indices.is_empty() {
        return absent.note(
            "GPU utilisation, memory, power, temperature, SM clock",
            why_no_gpu(run),
        );
    }
    let (throttles, xids) = gpu_events(run, &indices);
    let mut out = String::new();
    for panel in gpu_panels() {
        out.push_str(&gpu_panel(run, absent, &indices, &xids, panel));
    }
    out.push_str(&gpu_event_lanes(run, &indices, &throttles, &xids));
    out.push_str(&gpu_events_seen(&throttles, &xids));
    out
}

fn pools(run: &Run, absent: &mut Absent) -> String {
    if run.metrics.is_empty() {
        return absent.note("pool fill and bottleneck hint", why_no_metrics(run));
    }
    let mut out = pool_fill(run);
    out.push_str(&bottleneck_hints(run));
    out
}

/// Each pool's fill, and the share of the window its producers were blocked and its
/// consumers starved.
fn pool_fill(run: &Run) -> String {
    let mut c = Chart::new(
        "pools",
        "Pool fill, producers blocked and consumers starved (share of the window)",
        XAxis::Time,
        run.time_range(),
        "%",
    )
    .marks(&run.resumes(), "resumed");
    c.yl = Some((0.0, 100.0));
    type PoolOf = fn(&Pipeline) -> &Pool;
    type Share = fn(&Pool) -> f64;
    let pools: [(PoolOf, &str, &str, &str); 2] = [
        (|p| &p.tokens_pool, "tokens_pool", "token pool", "#1f77b4"),
        (
            |p| &p.hidden_pool,
            "hidden_pool",
            "hidden-state pool",
            "#ff7f0e",
        ),
    ];
    for (pool_of, pool, label, color) in pools {
        let shares: [(Share, &str, &str, Option<&str>); 3] = [
            (|p| p.fill_ratio, "fill", "pool-fill", None),
            (
                |p| p.producers_blocked_share,
                "producers blocked",
                "pool-blocked",
                Some("6 3"),
            ),
            (
                |p| p.consumers_starved_share,
                "consumers starved",
                "pool-starved",
                Some("1 3"),
            ),
        ];
        for (key, what, class, dash) in shares {
            let pts = run.windows(|m| Some(key(pool_of(&m.pipeline)) * 100.0));
            let s = Series::new(format!("{label}: {what}"), class, color, pts)
                .attrs(format!(r#" data-pool="{pool}""#));
            c.series.push(match dash {
                Some(d) => s.dash(d),
                None => s,
            });
        }
    }
    c.render(&|_| String::new())
}

/// The bottleneck hint over time: one coloured band per window, one colour per kind of
/// hint.
fn bottleneck_hints(run: &Run) -> String {
    let mut hints: Vec<String> = Vec::new();
    /// (seconds, window length, the hint's kind and text)
    type HintWindow = (f64, f64, Option<(usize, String)>);
    let per_window: Vec<HintWindow> = run
        .metrics
        .iter()
        .filter_map(|m| {
            let t = run.window_secs(m)?;
            let text = m.pipeline.bottleneck_hint.as_deref();
            // One colour per kind of hint: its figures do not count.
            let h = text.map(|h| {
                let kind = without_figures(h);
                match hints.iter().position(|x| *x == kind) {
                    Some(i) => i,
                    None => {
                        hints.push(kind);
                        hints.len() - 1
                    }
                }
            });
            Some((t, m.window_s, h.zip(text.map(String::from))))
        })
        .collect();
    let mut c = Chart::new(
        "bottleneck",
        "Bottleneck hint per metrics window",
        XAxis::Time,
        run.time_range(),
        "",
    )
    .marks(&run.resumes(), "resumed");
    c.plot_h = 22.0;
    c.y_ticks = false;
    let hint_color = |i: usize| PALETTE[(i + 3) % PALETTE.len()];
    c.legend_extra = hints
        .iter()
        .enumerate()
        .map(|(i, h)| (hint_color(i).to_string(), h.clone()))
        .collect();
    c.legend_extra
        .push(("#dddddd".into(), "no hint (balanced)".into()));
    // Consecutive windows without a hint are one span (a long balanced run is one rect).
    let mut spans: Vec<HintWindow> = Vec::new();
    for (t, w, h) in per_window {
        match (spans.last_mut(), &h) {
            (Some((t_last, w_last, None)), None) => {
                *w_last += t - *t_last;
                *t_last = t;
            }
            _ => spans.push((t, w, h)),
        }
    }
    c.render(&|f: &Frame| {
        let mut s = String::new();
        for (t, w, h) in &spans {
            let (a, b) = (f.px((t - w).max(0.0)), f.px(*t));
            let (color, text) = match h {
                Some((i, text)) => (hint_color(*i), text.as_str()),
                None => ("#dddddd", ""),
            };
            let _ = write!(
                s,
                r#"<rect class="hint" data-t="{t:.3}" data-hint="{}" x="{a:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{color}"><title>{}</title></rect>"#,
                esc(text),
                f.top,
                (b - a).max(1.0),
                f.bottom - f.top,
                esc(if text.is_empty() { "no hint" } else { text })
            );
        }
        s
    })
}

/// "targets blocked 60% on ..." → "targets blocked N% on ...".
fn without_figures(s: &str) -> String {
    let mut out = String::new();
    let mut in_num = false;
    for c in s.chars() {
        if c.is_ascii_digit() || (in_num && c == '.') {
            if !in_num {
                out.push('N');
            }
            in_num = true;
        } else {
            in_num = false;
            out.push(c);
        }
    }
    out
}

/// Per worker, per phase: (the sum of its milliseconds × window length, the sum of the
/// window lengths) over the metrics windows.
type PhaseSums = BTreeMap<String, BTreeMap<String, (f64, f64)>>;

/// The phase timings of every worker over the run's metrics windows.
fn phase_sums(run: &Run) -> PhaseSums {
    let mut acc = PhaseSums::new();
    for m in &run.metrics {
        let w = m.window_s.max(1e-6);
        for (worker, ph) in &m.pipeline.phase_ms_by_worker {
            for (p, &ms) in ph {
                if ms.is_finite() {
                    let e = acc
                        .entry(worker.clone())
                        .or_default()
                        .entry(p.clone())
                        .or_default();
                    e.0 += ms * w;
                    e.1 += w;
                }
            }
        }
    }
    acc
}

/// The phases `acc` has, in pipeline order (those of no known place last, by name).
fn phase_order(acc: &PhaseSums) -> Vec<String> {
    const ORDER: [&str; 6] = [
        "wait",
        "forward",
        "forward_backward",
        "backward",
        "exchange",
        "optimizer",
    ];
    let mut names: Vec<String> = acc
        .values()
        .flat_map(|p| p.keys().cloned())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    names.sort_by_key(|n| {
        (
            ORDER.iter().position(|o| o == n).unwrap_or(ORDER.len()),
            n.clone(),
        )
    });
    names
}

/// One stacked bar per worker: the mean milliseconds of each phase per batch.
fn phases(run: &Run, absent: &mut Absent) -> String {
    let acc = phase_sums(run);
    if acc.is_empty() {
        return absent.note(
            "phase timings",
            if run.metrics.is_empty() {
                why_no_metrics(run)
            } else {
                "no worker reported phase timings yet".into()
            },
        );
    }
    let names = phase_order(&acc);
    let color = |n: &str| match n {
        "wait" => "#bdc3c7",
        "forward" => "#3498db",
        "forward_backward" => "#8e44ad",
        "backward" => "#9b59b6",
        "optimizer" => "#e67e22",
        _ => PALETTE[names.iter().position(|x| x == n).unwrap_or(0) % PALETTE.len()],
    };
    let mean = |w: &str, p: &str| acc[w].get(p).map_or(0.0, |(s, n)| s / n);
    let max_total = acc
        .keys()
        .map(|w| names.iter().map(|p| mean(w, p)).sum::<f64>())
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let names_w: Vec<String> = acc.keys().cloned().collect();
    let (left, font) = label_margin(&names_w, 12.0, 110.0);
    let (row, right) = (24.0, W - 90.0);
    let legend_y = 36.0;
    let height = 50.0 + row * acc.len() as f64 + 30.0;
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-chart="phases" width="{W}" height="{height:.0}" viewBox="0 0 {W} {height:.0}" font-family="sans-serif"><text x="{left}" y="16" font-size="13" font-weight="bold">Mean time per batch by phase and worker (ms, stacked)</text>"#
    );
    let mut lx = left;
    for n in &names {
        let _ = write!(
            s,
            r#"<rect x="{lx:.1}" y="{:.1}" width="14" height="10" fill="{}"/><text x="{:.1}" y="{legend_y}" font-size="11">{}</text>"#,
            legend_y - 9.0,
            color(n),
            lx + 18.0,
            esc(n)
        );
        lx += 30.0 + n.len() as f64 * 6.3;
    }
    for (i, w) in acc.keys().enumerate() {
        let y = 50.0 + row * i as f64;
        let _ = write!(
            s,
            r#"<text class="lane-label" x="{LANE_X}" y="{:.1}" font-size="{font:.1}">{}</text>"#,
            y + 9.0 + font / 3.0,
            esc(w)
        );
        let mut x = left;
        for p in &names {
            let ms = mean(w, p);
            if ms <= 0.0 {
                continue;
            }
            let width = ms / max_total * (right - left);
            let _ = write!(
                s,
                r#"<rect class="phase" data-worker="{}" data-phase="{}" data-ms="{ms:.3}" x="{x:.1}" y="{y:.1}" width="{width:.2}" height="18" fill="{}"><title>{}: {} {:.2} ms</title></rect>"#,
                esc(w),
                esc(p),
                color(p),
                esc(w),
                esc(p),
                ms
            );
            x += width;
        }
        let total: f64 = names.iter().map(|p| mean(w, p)).sum();
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{:.1}" font-size="11">{} ms</text>"#,
            x + 4.0,
            y + 13.0,
            fmt_num(total)
        );
    }
    s.push_str("</svg>");
    s
}

/// The samples loaded per length bucket over the run, shortest bucket first.
fn length_buckets(run: &Run) -> Vec<(String, u64)> {
    let mut buckets: BTreeMap<String, u64> = BTreeMap::new();
    for m in &run.metrics {
        for (k, v) in &m.pipeline.length_buckets {
            *buckets.entry(k.clone()).or_default() += v;
        }
    }
    // "<=64", "<=128", ..., ">1024": by the number in the label.
    let mut keys: Vec<(String, u64)> = buckets.into_iter().collect();
    let num = |k: &str| -> (u8, u64) {
        (
            k.starts_with('>') as u8,
            k.trim_start_matches(['<', '>', '='])
                .parse()
                .unwrap_or(u64::MAX),
        )
    };
    keys.sort_by_key(|(k, _)| num(k));
    keys
}

/// The plot area of both halves of the composition chart: (top, bottom).
const COMPOSITION_Y: (f64, f64) = (30.0, 170.0);

fn composition(run: &Run, absent: &mut Absent) -> String {
    let keys = length_buckets(run);
    if keys.iter().all(|(_, n)| *n == 0) {
        return absent.note(
            "batch composition",
            if run.metrics.is_empty() {
                why_no_metrics(run)
            } else {
                "no batch was loaded in any metrics window".into()
            },
        );
    }
    let height = COMPOSITION_Y.1 + 40.0;
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-chart="length-buckets" width="{W}" height="{height:.0}" viewBox="0 0 {W} {height:.0}" font-family="sans-serif">"#
    );
    s.push_str(&bucket_bars(&keys));
    s.push_str(&padding_efficiency(run));
    s.push_str("</svg>");
    s
}

/// The left half of the composition chart: a bar per length bucket.
fn bucket_bars(keys: &[(String, u64)]) -> String {
    let max = keys.iter().map(|k| k.1).max().unwrap_or(1).max(1) as f64;
    let total: u64 = keys.iter().map(|k| k.1).sum();
    let (left, right) = (64.0, W / 2.0 - 10.0);
    let (top, bottom) = COMPOSITION_Y;
    let mut s = format!(
        r#"<text x="{left}" y="16" font-size="13" font-weight="bold">Sequence lengths of the batches loaded ({total} samples)</text>"#
    );
    let _ = write!(
        s,
        r##"<rect x="{left}" y="{top}" width="{}" height="{}" fill="#fcfcfc" stroke="#999"/>"##,
        right - left,
        bottom - top
    );
    let bw = (right - left) / keys.len() as f64;
    for (i, (k, n)) in keys.iter().enumerate() {
        let h = *n as f64 / max * (bottom - top - 14.0);
        let x = left + bw * i as f64;
        let _ = write!(
            s,
            r##"<rect class="bucket" data-bucket="{}" data-count="{n}" x="{:.1}" y="{:.1}" width="{:.1}" height="{h:.1}" fill="#5dade2"><title>{}: {n}</title></rect><text x="{:.1}" y="{:.1}" font-size="10" text-anchor="middle">{}</text><text x="{:.1}" y="{:.1}" font-size="10" text-anchor="middle">{n}</text>"##,
            esc(k),
            x + bw * 0.1,
            bottom - h,
            bw * 0.8,
            esc(k),
            x + bw / 2.0,
            bottom + 13.0,
            esc(k),
            x + bw / 2.0,
            bottom - h - 3.0
        );
    }
    let _ = write!(
        s,
        r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="middle">tokens per sample (bucket)</text>"#,
        (left + right) / 2.0,
        bottom + 30.0
    );
    s
}

/// The right half of the composition chart: the padding efficiency over time.
fn padding_efficiency(run: &Run) -> String {
    let (top, bottom) = COMPOSITION_Y;
    let mut s = String::new();
    let pad = run.windows(|m| m.pipeline.padding_efficiency.map(|v| v * 100.0));
    let f = Frame {
        x: run.time_range(),
        yl: (0.0, 100.0),
        yr: (0.0, 1.0),
        left: W / 2.0 + 50.0,
        right: W - 24.0,
        top,
        bottom,
    };
    let mean = weighted_stats(
        &run.metrics
            .iter()
            .filter_map(|m| Some((m.pipeline.padding_efficiency? * 100.0, m.window_s)))
            .collect::<Vec<_>>(),
    );
    let _ = write!(
        s,
        r##"<text x="{:.1}" y="16" font-size="13" font-weight="bold">Padding efficiency{}</text><rect x="{:.1}" y="{top}" width="{:.1}" height="{:.1}" fill="#fcfcfc" stroke="#999"/>"##,
        f.left,
        mean.map_or(String::new(), |m| format!(" (mean {:.1} %)", m.0)),
        f.left,
        f.right - f.left,
        bottom - top
    );
    for t in [0.0, 25.0, 50.0, 75.0, 100.0] {
        let _ = write!(
            s,
            r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e4e4e4"/><text x="{:.1}" y="{:.1}" font-size="10" text-anchor="end">{t}</text>"##,
            f.left,
            f.right,
            f.left - 4.0,
            f.py(t) + 3.5,
            y = f.py(t)
        );
    }
    let _ = write!(
        s,
        r#"<text transform="translate({:.1} {:.1}) rotate(-90)" font-size="11" text-anchor="middle">% real tokens</text>"#,
        f.left - 34.0,
        (top + bottom) / 2.0
    );
    for t in time_ticks(f.x.0, f.x.1) {
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{:.1}" font-size="10" text-anchor="middle">{}</text>"#,
            f.px(t),
            bottom + 13.0,
            fmt_dur(t)
        );
    }
    let _ = write!(
        s,
        r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="middle">time since the run started</text>"#,
        (f.left + f.right) / 2.0,
        bottom + 30.0
    );
    for seg in pad.split(|p| !p.1.is_finite()).filter(|g| !g.is_empty()) {
        let pts: Vec<String> = seg
            .iter()
            .map(|(a, b)| format!("{:.1},{:.1}", f.px(*a), f.py(*b)))
            .collect();
        let _ = write!(
            s,
            r##"<polyline class="padding-efficiency" fill="none" stroke="#1e8449" stroke-width="1.5" points="{}"/>"##,
            pts.join(" ")
        );
    }
    s
}

/// One row per worker: spawns, exits (code or signal), hangs, restarts, rollbacks and the
/// stop on the shared time axis.
fn lifelines(run: &Run, absent: &mut Absent) -> String {
    let mut workers: Vec<String> = run
        .events
        .iter()
        .filter_map(|e| e["worker"].as_str().map(String::from))
        .collect();
    workers.sort();
    workers.dedup();
    if workers.is_empty() {
        return absent.note(
            "worker lifelines",
            "no worker event recorded in events.jsonl",
        );
    }
    let row_h = 24.0;
    let mut c = Chart::new(
        "lifelines",
        "Worker lifelines",
        XAxis::Time,
        run.time_range(),
        "",
    )
    .marks(&run.resumes(), "resumed")
    .lanes(&workers, row_h);
    for (name, color) in [
        ("spawn", "#27ae60"),
        ("exit", "#c0392b"),
        ("hang", "#e67e22"),
        ("restart", "#8e44ad"),
        ("rollback / stop", "#34495e"),
    ] {
        c.legend_extra.push((color.into(), name.into()));
    }
    c.render(&|f: &Frame| {
        let mut s = String::new();
        for (i, w) in workers.iter().enumerate() {
            let y = f.top + row_h * (i as f64 + 0.5);
            let _ = write!(s, r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ccc"/>"##, f.left, f.right);
            // Up: from each spawn to the next exit.
            let mut up_from: Option<f64> = None;
            for e in run.events.iter().filter(|e| e["worker"].as_str() == Some(w.as_str())) {
                let Some(t) = run.secs(&e["time"]) else { continue };
                let ev = e["event"].as_str().unwrap_or("");
                match ev {
                    "spawn" => up_from = Some(t),
                    "exit" => {
                        if let Some(a) = up_from.take() {
                            let _ = write!(s, r##"<line class="up" x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#27ae60" stroke-width="3" stroke-opacity="0.35"/>"##, f.px(a), f.px(t));
                        }
                    }
                    _ => {}
                }
                let (color, rect) = match ev {
                    "spawn" => ("#27ae60", false),
                    "exit" => ("#c0392b", true),
                    "hang" => ("#e67e22", true),
                    "restart" => ("#8e44ad", false),
                    _ => ("#555", false),
                };
                let what = match (e["code"].as_i64(), e["signal"].as_str()) {
                    (Some(c), _) => format!("{ev} (exit code {c})"),
                    (_, Some(sig)) => format!("{ev} ({sig})"),
                    _ => ev.to_string(),
                };
                let title = format!("<title>{} {} at {}</title>", esc(w), esc(&what), esc(e["time"].as_str().unwrap_or("")));
                if rect {
                    let _ = write!(s, r#"<rect class="ev-{ev}" x="{:.1}" y="{:.1}" width="6" height="12" fill="{color}">{title}</rect>"#, f.px(t) - 3.0, y - 6.0);
                } else {
                    let _ = write!(s, r#"<circle class="ev-{ev}" cx="{:.1}" cy="{y:.1}" r="4" fill="{color}">{title}</circle>"#, f.px(t));
                }
            }
            if let Some(a) = up_from {
                let _ = write!(s, r##"<line class="up" x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#27ae60" stroke-width="3" stroke-opacity="0.35"/>"##, f.px(a), f.right);
            }
        }
        // Run-wide events (rollbacks, the stop, the end) as vertical marks.
        for e in run.events.iter().filter(|e| matches!(e["event"].as_str(), Some("rollback" | "stop" | "run_end"))) {
            if let Some(t) = run.secs(&e["time"]) {
                let ev = e["event"].as_str().unwrap_or("");
                let why = e["reason"].as_str().map(|r| format!(": {r}")).unwrap_or_default();
                let _ = write!(
                    s,
                    r##"<line class="ev-{ev}" x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#34495e" stroke-dasharray="2 2"><title>{ev}{}</title></line>"##,
                    f.top,
                    f.bottom,
                    esc(&why),
                    x = f.px(t)
                );
            }
        }
        s
    })
}

/// The page of the run in `run`.
pub fn render(dir: &Path) -> String {
    let run = Run::read(dir);
    let mut absent = Absent::default();
    let tps = weighted_stats(
        &run.metrics
            .iter()
            .map(|m| (m.pipeline.tokens_per_s_trained, m.window_s))
            .collect::<Vec<_>>(),
    );
    let sections = [
        ("Training", training(&run, &mut absent)),
        ("Throughput", throughput(&run, &mut absent)),
        ("GPUs", gpus(&run, &mut absent)),
        ("Pipeline: pools and bottleneck", pools(&run, &mut absent)),
        ("Phase timings", phases(&run, &mut absent)),
        ("Batch composition", composition(&run, &mut absent)),
        ("Worker lifelines", lifelines(&run, &mut absent)),
    ];
    let mut h = String::new();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html xmlns=\"http://www.w3.org/1999/xhtml\"><head><meta charset=\"utf-8\"/>{}<title>dflash-supervise report: {}</title>\
         <style>body{{font-family:sans-serif;margin:20px;max-width:1600px}}th{{text-align:left;font-weight:normal;color:#555;padding:2px 12px 2px 0}}\
         td{{padding:2px 10px;border-bottom:1px solid #eee}}h2{{margin-top:28px;border-bottom:1px solid #ccc}}h3{{margin:14px 0 4px}}\
         svg{{display:block;margin:6px 0}}.absent{{color:#a04000}}.note{{color:#555;font-size:90%}}</style></head><body>\
         <h1>dflash-supervise run report</h1>",
        // A live run's page (report --watch rewrites it) reloads itself.
        if run.live {
            r#"<meta http-equiv="refresh" content="15"/>"#
        } else {
            ""
        },
        esc(&run.dir.display().to_string())
    );
    let _ = write!(
        h,
        r#"<p class="note">Written {} from {}{}.</p>"#,
        crate::run::rundir::now_rfc3339(),
        esc(&run.dir.display().to_string()),
        if run.live {
            " while the run was live"
        } else {
            ""
        }
    );
    h.push_str(&summary(&run, tps));
    h.push_str(&settings(&run.dir));
    for (title, body) in &sections {
        let _ = write!(h, "<h2>{}</h2>{body}", esc(title));
    }
    if let Some(body) = nodes(&run) {
        let _ = write!(h, "<h2>Nodes</h2>{body}");
    }
    h.push_str(r#"<h2>Not shown</h2><ul class="not-shown">"#);
    if absent.0.is_empty() && run.torn.is_empty() {
        h.push_str("<li>nothing: every series the report draws was recorded</li>");
    }
    for (series, why) in &absent.0 {
        let _ = write!(
            h,
            r#"<li data-series="{}">{}: {}</li>"#,
            esc(series),
            esc(series),
            esc(why)
        );
    }
    for f in &run.torn {
        let _ = write!(h, "<li>{f}: a line cut off by a crash was skipped</li>");
    }
    h.push_str("</ul></body></html>\n");
    h
}

/// Write the report of the run in `run` to `out` (atomically: readers never see half a page).
pub fn write(run: &Path, out: &Path) -> Result<(), Error> {
    let page = render(run);
    let tmp = out.with_extension(format!("html.{}.tmp", std::process::id()));
    std::fs::write(&tmp, page)
        .and_then(|_| std::fs::rename(&tmp, out))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::input(format!("--out {}", out.display()), e)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(d.path().join(name), text).unwrap();
        }
        d
    }

    const STATE: &str = r#"{"started_at": "2026-01-01T00:00:00.000Z", "started_at_unix_ms": 1767225600000, "phase": "running",
        "workers": [{"name": "target-0", "gpu": "0", "restarts": 0}, {"name": "drafter-0", "gpu": "1", "restarts": 0}]}"#;
    const NO_GPU_WINDOW: &str = r#"{"time": "2026-01-01T00:00:10.000Z", "window_s": 10.0, "gpu": {"samples": 0, "gpus": []}, "pipeline": {"tokens_per_s_trained": 100.0}}"#;

    /// Every chart's plot rectangle (x from, x to) and the x of everything drawn in it:
    /// polyline points, circles and markers.
    fn plotted_xs(html: &str) -> Vec<((f64, f64), Vec<f64>)> {
        let num = |t: &str, key: &str| -> Option<f64> {
            let at = t.find(&format!(" {key}=\""))? + key.len() + 3;
            t[at..].split('"').next()?.parse().ok()
        };
        html.split("<svg ")
            .skip(1)
            .filter_map(|svg| {
                let svg = svg.split("</svg>").next()?;
                let clip = svg.split("<clipPath").nth(1)?;
                let (x, w) = (num(clip, "x")?, num(clip, "width")?);
                let plot = svg.split(r#"<g class="plot""#).nth(1)?;
                let mut xs = Vec::new();
                for poly in plot.split(" points=\"").skip(1) {
                    let pts = poly.split('"').next().unwrap_or("");
                    xs.extend(
                        pts.split(' ')
                            .filter_map(|p| p.split(',').next()?.parse::<f64>().ok()),
                    );
                }
                for c in plot.split("<circle").skip(1) {
                    xs.extend(num(c, "cx"));
                }
                for l in plot.split(r#"<line class="mark""#).skip(1) {
                    xs.extend(num(l, "x1"));
                }
                Some(((x, x + w), xs))
            })
            .collect()
    }

    /// A job's leader: a Nodes table with its own windows and those it kept of node 1 (a
    /// window of node 1 repeated in two of the leader's counted once); none for one node.
    #[test]
    fn a_jobs_report_has_a_row_per_node_from_the_windows_the_leader_kept() {
        let gpu = |util: f64| {
            format!(
                r#"{{"samples": 1, "gpus": [{{"index": 0, "util_gpu_pct": {{"mean": {util}, "max": {util}, "samples": 1}}}}]}}"#
            )
        };
        let follower = |t: &str, tps: f64| {
            format!(
                r#"{{"time": "2026-01-01T{t}.000Z", "window_s": 10.0, "node": 1, "gpu": {}, "pipeline": {{"tokens_per_s_trained": {tps}}}, "restarts": 2}}"#,
                gpu(80.0)
            )
        };
        let leader = |t: &str, f: &str| {
            format!(
                r#"{{"time": "2026-01-01T{t}.000Z", "window_s": 10.0, "node": 0, "gpu": {}, "pipeline": {{"tokens_per_s_trained": 100.0}}, "nodes": {{"1": {f}}}}}"#,
                gpu(40.0)
            )
        };
        let metrics = [
            leader("00:00:10", &follower("00:00:09", 90.0)),
            leader("00:00:20", &follower("00:00:09", 90.0)),
            leader("00:00:30", &follower("00:00:29", 110.0)),
        ]
        .join("\n");
        let d = run_dir(&[("state.json", STATE), ("metrics.jsonl", &metrics)]);
        let page = render(d.path());
        let row = |n: u32| {
            let at = page
                .find(&format!(r#"<tr data-node="{n}">"#))
                .unwrap_or_else(|| panic!("a row of node {n}: {page}"));
            page[at..].split("</tr>").next().unwrap().to_string()
        };
        assert!(page.contains("<h2>Nodes</h2>"), "{page}");
        assert_eq!(
            row(0),
            r#"<tr data-node="0"><td>0 (leader)</td><td>3</td><td>1</td><td>40%</td><td>100</td><td>0</td>"#
        );
        assert_eq!(
            row(1),
            r#"<tr data-node="1"><td>1</td><td>2</td><td>1</td><td>80%</td><td>100</td><td>2</td>"#
        );
        let one = run_dir(&[("state.json", STATE), ("metrics.jsonl", NO_GPU_WINDOW)]);
        assert!(!render(one.path()).contains("<h2>Nodes</h2>"));
    }

    #[test]
    fn a_resumed_run_is_one_timeline_with_every_point_inside_its_plot_and_the_resume_marked() {
        // Session 1 ran 00:00–00:30; the resume started at 01:00 (state.json's start).
        let state = STATE.replace("1767225600000", "1767229200000");
        let window = |t: &str, tps: f64| {
            format!(
                r#"{{"time": "2026-01-01T{t}.000Z", "window_s": 10.0, "gpu": {{"samples": 0, "gpus": []}}, "pipeline": {{"tokens_per_s_trained": {tps}, "hidden_pool": {{"fill_ratio": 0.5}}}}}}"#
            )
        };
        let metrics = [
            window("00:00:10", 100.0),
            window("00:00:20", 120.0),
            window("01:00:10", 130.0),
            window("01:00:20", 140.0),
        ];
        let events = [
            r#"{"time": "2026-01-01T00:00:00.000Z", "event": "run_start"}"#,
            r#"{"time": "2026-01-01T00:00:15.000Z", "event": "role_move", "from": "drafter-2", "to": "target-1"}"#,
            r#"{"time": "2026-01-01T00:00:30.000Z", "event": "run_end", "reason": "interrupted"}"#,
            r#"{"time": "2026-01-01T01:00:00.000Z", "event": "run_start"}"#,
        ];
        let d = run_dir(&[
            ("state.json", &state),
            ("metrics.jsonl", &metrics.join("\n")),
            ("events.jsonl", &events.join("\n")),
        ]);
        let html = render(d.path());
        let charts = plotted_xs(&html);
        assert!(charts.iter().any(|(_, xs)| xs.len() >= 4), "{html}");
        for ((lo, hi), xs) in &charts {
            for x in xs {
                assert!(
                    *lo - 0.05 <= *x && *x <= *hi + 0.05,
                    "{x} outside [{lo}, {hi}]"
                );
            }
        }
        // The resume, one hour in, is marked on the time charts; a move between the
        // roles (--targets auto) on the tokens/s chart.
        assert!(
            html.contains(r#"<line class="mark" data-x="3600.000""#),
            "{html}"
        );
        assert!(
            html.contains(r#"<line class="mark" data-x="15.000" x1"#)
                && html.contains("drafter-2 → target-1</text>"),
            "{html}"
        );
    }

    #[test]
    fn the_loss_ema_follows_a_step_and_starts_at_the_first_value() {
        let pts: Vec<(f64, f64)> = (0..100)
            .map(|i| (i as f64, if i < 50 { 4.0 } else { 2.0 }))
            .collect();
        let e = ema(&pts, 9.0);
        assert_eq!(e[0], (0.0, 4.0), "bias-corrected: no ramp from 0");
        assert!((e[49].1 - 4.0).abs() < 1e-9);
        assert!(e[52].1 < 4.0 && e[52].1 > 2.0, "it lags a step");
        assert!((e[99].1 - 2.0).abs() < 1e-3, "and reaches it");
        let gap = ema(&[(0.0, 1.0), (1.0, f64::NAN), (2.0, 1.0)], 3.0);
        assert!(gap.iter().all(|p| p.1 == 1.0), "{gap:?}");
    }

    #[test]
    fn a_long_series_is_thinned_to_the_plots_columns_keeping_its_extremes() {
        let f = Frame {
            x: (0.0, 50_000.0),
            yl: (0.0, 10.0),
            yr: (0.0, 1.0),
            left: 64.0,
            right: 876.0,
            top: 0.0,
            bottom: 100.0,
        };
        let pts: Vec<(f64, f64)> = (0..50_000)
            .map(|i| {
                (
                    i as f64,
                    if i == 31_337 {
                        9.5
                    } else if i == 777 {
                        0.25
                    } else {
                        5.0
                    },
                )
            })
            .collect();
        let thin = per_pixel(&pts, &f);
        assert!(thin.len() <= 4 * 813, "{} points", thin.len());
        assert!(
            thin.contains(&(31_337.0, 9.5)) && thin.contains(&(777.0, 0.25)),
            "extremes kept"
        );
        assert!(thin.windows(2).all(|w| w[0].0 < w[1].0), "in x order");
        assert_eq!((thin[0], thin[thin.len() - 1]), (pts[0], pts[49_999]));
        // A short series is drawn whole.
        assert_eq!(per_pixel(&pts[..500], &f), pts[..500].to_vec());
    }

    #[test]
    fn held_out_evals_are_drawn_beside_the_training_curves_in_the_final_lineage() {
        let step = |s: u64| format!(r#"{{"step":{s},"loss":3.0,"acceptance":1.5,"lr":0.001}}"#);
        let eval = |s: u64, a: f64| {
            format!(r#"{{"t":1,"eval":{{"step":{s},"loss":2.0,"acceptance":{a}}}}}"#)
        };
        let lines = [
            step(1),
            step(2),
            eval(2, 1.25),
            step(3),
            step(4),
            eval(4, 1.75),
            r#"{"rollback":{"from":4,"to":3}}"#.to_string(),
            step(4),
        ];
        let d = run_dir(&[("train.jsonl", &lines.join("\n"))]);
        let html = render(d.path());
        for class in ["eval-loss", "eval-acceptance"] {
            let dots = html
                .matches(&format!(r#"<circle class="{class}" data-step="2""#))
                .count();
            assert_eq!(dots, 1, "the {class} point of step 2");
            assert!(
                !html.contains(&format!(r#"<circle class="{class}" data-step="4""#)),
                "the {class} point of the rolled-back step 4"
            );
        }
        let evals = lineage_evals(&read_jsonl(&d.path().join("train.jsonl")).0);
        assert_eq!(evals.len(), 1, "the eval of the rolled-back step 4 is gone");
        assert_eq!(evals[0]["step"], 2);
        // The training steps are read as before: eval lines are not steps.
        let steps = lineage_steps(&read_jsonl(&d.path().join("train.jsonl")).0);
        assert_eq!(steps.len(), 4);
    }

    #[test]
    fn real_tau_is_drawn_at_its_steps_with_its_intervals_in_the_final_lineage() {
        let step = |s: u64| format!(r#"{{"step":{s},"loss":3.0,"acceptance":1.5,"lr":0.001}}"#);
        let tau = |s: u64, p: f64| {
            format!(
                r#"{{"t":1,"tau":{{"step":{s},"pooled":{p},"pooled_ci95":[1.0,3.0],"mean_of_means":2.0,"mean_of_means_ci95":[1.5,2.5]}}}}"#
            )
        };
        let lines = [
            step(1),
            step(2),
            tau(2, 1.5),
            step(3),
            step(4),
            tau(4, 2.5),
            r#"{"rollback":{"from":4,"to":3}}"#.to_string(),
            step(4),
        ];
        let d = run_dir(&[("train.jsonl", &lines.join("\n"))]);
        let html = render(d.path());
        for class in ["tau-pooled", "tau-mean"] {
            assert_eq!(
                html.matches(&format!(r#"<circle class="{class}" data-step="2""#))
                    .count(),
                1,
                "the {class} point of step 2"
            );
            assert!(
                !html.contains(&format!(r#"<circle class="{class}" data-step="4""#)),
                "the {class} point of the rolled-back step 4"
            );
        }
        assert!(html.contains("tau-pooled-ci") && html.contains("Real acceptance length"));
        let none = run_dir(&[("train.jsonl", &step(1))]);
        assert!(!render(none.path()).contains("tau-pooled"));
    }

    #[test]
    fn an_empty_run_dir_renders_and_names_every_missing_series() {
        let d = run_dir(&[]);
        let page = render(d.path());
        for series in [
            "loss and acceptance",
            "tokens/s",
            "GPU utilisation",
            "pool fill",
            "phase timings",
            "batch composition",
            "worker lifelines",
        ] {
            assert!(
                page.contains(&format!(r#"<li data-series="{series}"#)),
                "{series} is not named: {page}"
            );
        }
        assert!(page.contains("metrics.jsonl is empty or missing"));
        assert!(page.contains("did not end cleanly"));
    }

    #[test]
    fn the_reason_for_no_gpu_series_is_the_run_s() {
        let off =
            r#"{"event": "run_start", "time": "2026-01-01T00:00:00.000Z", "gpu_metrics": false}"#;
        let d = run_dir(&[
            ("state.json", STATE),
            ("events.jsonl", off),
            ("metrics.jsonl", NO_GPU_WINDOW),
        ]);
        let page = render(d.path());
        assert!(
            page.contains("GPU metrics were turned off (--no-gpu-metrics)"),
            "{page}"
        );
        let on =
            r#"{"event": "run_start", "time": "2026-01-01T00:00:00.000Z", "gpu_metrics": true}"#;
        let log = "2026-01-01T00:00:00.100Z WARN  GPU metrics are off: the NVIDIA driver is not loaded. Lost: utilisation\n";
        let d = run_dir(&[
            ("state.json", STATE),
            ("events.jsonl", on),
            ("metrics.jsonl", NO_GPU_WINDOW),
            ("supervisor.log", log),
        ]);
        assert!(render(d.path()).contains("GPU metrics are off: the NVIDIA driver is not loaded"));
        let cpu = STATE
            .replace(r#""gpu": "0""#, r#""gpu": "cpu""#)
            .replace(r#""gpu": "1""#, r#""gpu": "cpu""#);
        let d = run_dir(&[
            ("state.json", &cpu),
            ("events.jsonl", on),
            ("metrics.jsonl", NO_GPU_WINDOW),
        ]);
        assert!(render(d.path()).contains("every worker ran on CPU"));
    }

    #[test]
    fn weighted_percentiles_and_figures() {
        let (m, p10, p90) = weighted_stats(&[(100.0, 9.0), (0.0, 1.0), (f64::NAN, 5.0)]).unwrap();
        assert!((m - 90.0).abs() < 1e-9 && p10 == 0.0 && p90 == 100.0);
        assert_eq!(
            without_figures("targets blocked 60% on a full pool: add 2.5 drafters"),
            "targets blocked N% on a full pool: add N drafters"
        );
        assert_eq!(fmt_dur(65.0), "1m05s");
        assert_eq!(fmt_dur(7380.0), "2h03m");
        assert_eq!(fmt_value(1.0), "1.000");
        assert_eq!(fmt_value(11.6), "11.60");
    }

    #[test]
    fn value_axes_fit_their_data_with_round_ticks_and_reach_0_only_near_it() {
        // A loss from 11.9 to 11.6: a margin each side, no 0.
        let (lo, hi) = fit([11.9, 11.75, 11.6]);
        assert!(
            11.5 < lo && lo < 11.6 && 11.9 < hi && hi < 12.0,
            "{lo} {hi}"
        );
        let (t, st) = ticks(lo, hi, 4.0);
        assert_eq!(st, 0.1);
        assert_eq!(
            t.iter().map(|v| tick_label(*v, st)).collect::<Vec<_>>(),
            ["11.6", "11.7", "11.8", "11.9"]
        );
        // 8 down to 0.3: from 0.
        let (lo, hi) = fit([0.3, 7.8]);
        assert!(lo == 0.0 && 7.8 < hi && hi < 8.2, "{lo} {hi}");
        assert_eq!(ticks(lo, hi, 4.0).0, [0.0, 2.0, 4.0, 6.0, 8.0]);
        // Below 0 the same way; one value (a lone point) in the middle of its axis.
        assert_eq!(fit([-7.8, -0.3]).1, 0.0);
        assert_eq!(fit([1.0, 1.0]), (0.9, 1.1));
        assert_eq!(fit([0.0]), (-1.0, 1.0));
        assert_eq!(fit([f64::NAN]), (0.0, 1.0));
        // Multiples of the step (not sums, which drift): an integer tick is exact.
        let t = ticks_at(0.5, 1.5, 0.2);
        assert_eq!(t.len(), 5);
        assert_eq!(t[2], 1.0);
    }

    #[test]
    fn a_lone_point_is_drawn_inside_its_plot_with_its_value_beside_it() {
        let mut c = Chart::new("c", "c", XAxis::Steps, (7.0, 7.0), "τ");
        c.series
            .push(Series::new("τ", "tau-pooled", "#000", vec![(7.0, 2.5)]).dots());
        let svg = c.render(&|_| String::new());
        let num = |t: &str, key: &str| -> f64 {
            let at = t.find(&format!(" {key}=\"")).unwrap() + key.len() + 3;
            t[at..].split('"').next().unwrap().parse().unwrap()
        };
        let rect = svg.split(r#"<rect class="plot-area""#).nth(1).unwrap();
        let (l, t) = (num(rect, "x"), num(rect, "y"));
        let (r, b) = (l + num(rect, "width"), t + num(rect, "height"));
        let dot = svg.split("<circle").nth(1).unwrap();
        let (cx, cy, rad) = (num(dot, "cx"), num(dot, "cy"), num(dot, "r"));
        assert!(
            l < cx - rad && cx + rad < r && t < cy - rad && cy + rad < b,
            "{svg}"
        );
        let label = svg
            .split(r#"<text class="value-label""#)
            .nth(1)
            .expect("a label");
        assert!((num(label, "x") - cx).abs() < 10.0 && (num(label, "y") - cy).abs() < 16.0);
        assert!(label.contains(">2.500</text>"), "{label}");
    }

    #[test]
    fn lane_names_get_a_margin_as_wide_as_the_longest() {
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // Short names: the usual margin.
        assert_eq!(
            label_margin(&names(&["target-0", "drafter-1"]), 12.0, 110.0),
            (110.0, 12.0)
        );
        // Long ones: a wider margin holding the longest whole.
        let long = names(&["target-0", "drafter-eu-west-node-17-b"]);
        let (left, font) = label_margin(&long, 12.0, 110.0);
        assert_eq!(font, 12.0);
        assert!(left >= LANE_X + text_width(&long[1], 12.0), "{left}");
        // Too long for a third of the page: a smaller font, still whole.
        let huge = names(&[&"x".repeat(200)]);
        let (left, font) = label_margin(&huge, 12.0, 110.0);
        assert!(
            font < 12.0 && LANE_X + text_width(&huge[0], font) <= left,
            "{left} {font}"
        );
        let c = Chart::new("l", "l", XAxis::Time, (0.0, 10.0), "").lanes(&long, 24.0);
        let svg = c.render(&|_| String::new());
        let clipped = svg.split("clip-path=").nth(1).unwrap();
        assert!(
            !clipped.contains("drafter-eu-west-node-17-b"),
            "the names are not clipped"
        );
        assert!(
            svg.contains(r#"font-size="12.0">drafter-eu-west-node-17-b</text>"#),
            "{svg}"
        );
    }
}
