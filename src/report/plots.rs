//! The report's plots, drawn with plotters' SVG backend into strings that the page inlines.
//!
//! Each plot is small and self-contained: a forest-plot cell (one interval on the shared axis
//! of its table), the axis above such a column, a stacked validity bar, and a histogram.
//! Every table row carries its own cells, so rows can be searched and hidden one by one while
//! the intervals of a table stay on one scale.

use plotters::coord::Shift;
use plotters::prelude::*;

use super::ReportError;

/// The colour of each verdict, in `aggregate::ALL_VERDICTS` order, then `other`.
pub const VERDICT_COLOURS: [RGBColor; 9] = [
    RGBColor(46, 139, 87),   // valid_answer
    RGBColor(230, 145, 56),  // empty_due_to_budget
    RGBColor(241, 196, 15),  // empty_unexplained
    RGBColor(142, 68, 173),  // truncated
    RGBColor(192, 57, 43),   // provider_error
    RGBColor(52, 152, 219),  // unscorable_language
    RGBColor(149, 117, 86),  // judge_unparseable
    RGBColor(120, 30, 30),   // judge_error
    RGBColor(127, 140, 141), // other
];

/// The CSS `#rrggbb` of a colour (the legend is HTML).
pub fn css(c: RGBColor) -> String {
    format!("#{:02x}{:02x}{:02x}", c.0, c.1, c.2)
}

/// The side margin of forest cells and their axis (room for the end labels; equal in both so
/// that cells line up with the axis).
const SIDE: u32 = 14;

fn plot_err(e: impl std::fmt::Display) -> ReportError {
    ReportError::Plot(e.to_string())
}

/// Draws with `f` on an SVG of `w` x `h` pixels and returns the SVG text.
fn svg(
    w: u32,
    h: u32,
    f: impl FnOnce(&DrawingArea<SVGBackend, Shift>) -> Result<(), ReportError>,
) -> Result<String, ReportError> {
    let mut buf = String::new();
    {
        let root = SVGBackend::with_string(&mut buf, (w, h)).into_drawing_area();
        f(&root)?;
        root.present().map_err(plot_err)?;
    }
    // Thousands of cells: drop what SVG assumes anyway (full opacity, line breaks).
    Ok(buf.replace(" opacity=\"1\"", "").replace('\n', ""))
}

/// One horizontal stacked bar: each `(count, colour)` gets a share of the width.
///
/// # Behavior
/// Zero counts draw nothing; a total of zero draws an empty grey outline.
pub fn stacked_bar(parts: &[(i64, RGBColor)], w: u32, h: u32) -> Result<String, ReportError> {
    let total: i64 = parts.iter().map(|p| p.0.max(0)).sum();
    svg(w, h, |root| {
        let mut chart = ChartBuilder::on(root)
            .build_cartesian_2d(0f64..(total.max(1) as f64), 0f64..1f64)
            .map_err(plot_err)?;
        let mut x = 0.0;
        let mut rects = Vec::new();
        for (n, c) in parts.iter().filter(|p| p.0 > 0) {
            rects.push(Rectangle::new([(x, 0.0), (x + *n as f64, 1.0)], c.filled()));
            x += *n as f64;
        }
        if total == 0 {
            rects.push(Rectangle::new(
                [(0.0, 0.0), (1.0, 1.0)],
                RGBColor(200, 200, 200).stroke_width(1),
            ));
        }
        chart.draw_series(rects).map_err(plot_err)?;
        Ok(())
    })
}

/// What one forest-plot cell shows beside its interval.
#[derive(Debug, Clone, Copy, Default)]
pub struct CellGuides {
    /// A shaded band, e.g. the comparison's MDE band `[-mde, +mde]`.
    pub band: Option<(f64, f64)>,
    /// A vertical reference line (zero for a difference).
    pub reference: Option<f64>,
    /// A second, hollow marker (the raw rate beside a corrected one).
    pub marker: Option<f64>,
}

/// A forest-plot cell: the interval `[lo, hi]` with its estimate on the axis `range`.
///
/// # Behavior
/// Values outside `range` are clipped to it; a missing interval draws only the estimate,
/// and a missing estimate draws nothing but the guides.
pub fn interval(
    value: Option<f64>,
    lo: Option<f64>,
    hi: Option<f64>,
    range: (f64, f64),
    guides: CellGuides,
    (w, h): (u32, u32),
) -> Result<String, ReportError> {
    let clip = |x: f64| x.clamp(range.0, range.1);
    svg(w, h, |root| {
        let mut chart = ChartBuilder::on(root)
            .margin_left(SIDE)
            .margin_right(SIDE)
            .build_cartesian_2d(range.0..range.1, 0f64..1f64)
            .map_err(plot_err)?;
        if let Some((a, b)) = guides.band {
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(clip(a), 0.0), (clip(b), 1.0)],
                    RGBColor(253, 235, 208).filled(),
                )))
                .map_err(plot_err)?;
        }
        if let Some(r) = guides.reference.filter(|r| *r >= range.0 && *r <= range.1) {
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![(r, 0.0), (r, 1.0)],
                    RGBColor(150, 150, 150).stroke_width(1),
                )))
                .map_err(plot_err)?;
        }
        if let Some(m) = guides.marker {
            chart
                .draw_series(std::iter::once(Circle::new(
                    (clip(m), 0.5),
                    4,
                    RGBColor(120, 120, 120).stroke_width(1),
                )))
                .map_err(plot_err)?;
        }
        let style = RGBColor(31, 58, 147).filled().stroke_width(2);
        match (value, lo, hi) {
            (Some(v), Some(l), Some(u)) => {
                chart
                    .draw_series(std::iter::once(ErrorBar::new_horizontal(
                        0.5,
                        clip(l),
                        clip(v),
                        clip(u),
                        style,
                        8,
                    )))
                    .map_err(plot_err)?;
            }
            (Some(v), _, _) => {
                chart
                    .draw_series(std::iter::once(Circle::new((clip(v), 0.5), 4, style)))
                    .map_err(plot_err)?;
            }
            _ => {}
        }
        Ok(())
    })
}

/// The axis above a column of forest-plot cells: ticks and labels on `range`, as percentages
/// when `as_pct`.
pub fn axis(range: (f64, f64), as_pct: bool, (w, h): (u32, u32)) -> Result<String, ReportError> {
    svg(w, h, |root| {
        let mut chart = ChartBuilder::on(root)
            .margin_left(SIDE)
            .margin_right(SIDE)
            .x_label_area_size(h.saturating_sub(2))
            .build_cartesian_2d(range.0..range.1, 0f64..1f64)
            .map_err(plot_err)?;
        let fmt = |x: &f64| {
            if as_pct {
                format!("{:.0}%", x * 100.0)
            } else {
                format!("{x:.2}")
            }
        };
        chart
            .configure_mesh()
            .disable_mesh()
            .disable_y_axis()
            .x_labels(5)
            .x_label_formatter(&fmt)
            .label_style(("sans-serif", 11))
            .draw()
            .map_err(plot_err)?;
        Ok(())
    })
}

/// A histogram of pre-binned counts: one bar per `(bin label, count)`.
pub fn histogram(
    bins: &[(String, i64)],
    x_desc: &str,
    colour: RGBColor,
    (w, h): (u32, u32),
) -> Result<String, ReportError> {
    let top = bins.iter().map(|b| b.1).max().unwrap_or(0).max(1) as f64 * 1.1;
    let n = bins.len().max(1);
    svg(w, h, |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(6)
            .x_label_area_size(34)
            .y_label_area_size(44)
            .build_cartesian_2d(0f64..n as f64, 0f64..top)
            .map_err(plot_err)?;
        let label = |x: &f64| {
            let i = x.floor() as usize;
            // Labels sit at the bars' centres; other tick positions stay blank.
            if (x - i as f64 - 0.5).abs() < 1e-9 {
                bins.get(i).map(|b| b.0.clone()).unwrap_or_default()
            } else {
                String::new()
            }
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n * 2 + 1)
            .x_label_formatter(&label)
            .y_labels(4)
            .y_label_formatter(&|y: &f64| format!("{y:.0}"))
            .x_desc(x_desc)
            .label_style(("sans-serif", 10))
            .axis_desc_style(("sans-serif", 11))
            .draw()
            .map_err(plot_err)?;
        chart
            .draw_series(
                bins.iter()
                    .enumerate()
                    .filter(|(_, b)| b.1 > 0)
                    .map(|(i, b)| {
                        Rectangle::new(
                            [(i as f64 + 0.08, 0.0), (i as f64 + 0.92, b.1 as f64)],
                            colour.filled(),
                        )
                    }),
            )
            .map_err(plot_err)?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_are_svg_with_no_reference_to_load() {
        let s = interval(
            Some(0.3),
            Some(0.2),
            Some(0.4),
            (0.0, 1.0),
            CellGuides::default(),
            (160, 16),
        )
        .unwrap();
        assert!(s.starts_with("<svg") && s.contains("</svg>"), "{s}");
        let h = histogram(
            &[("0".into(), 3), ("1-9".into(), 0), ("10+".into(), 7)],
            "chars",
            VERDICT_COLOURS[0],
            (300, 160),
        )
        .unwrap();
        assert!(h.contains("10+") && h.contains("<rect"), "{h}");
        let b = stacked_bar(&[(3, VERDICT_COLOURS[0]), (1, VERDICT_COLOURS[4])], 100, 10).unwrap();
        assert_eq!(b.matches("<rect").count(), 2, "{b}");
        for s in [s, h, b] {
            assert!(!s.contains("href") && !s.contains("src="));
        }
    }
}
