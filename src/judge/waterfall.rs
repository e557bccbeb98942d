//! The SHAP waterfall chart: how each question moves one prediction from the model's expected
//! value E[f(X)] (bottom) to the prediction f(x) (top), largest contributions on top.
//!
//! Written as SVG by hand (a few rects and text elements), rasterised to PNG by `resvg`, which
//! renders the same SVG with the system fonts, so the two files always agree.

use std::path::Path;

use super::JudgeError;

/// One bar: a question, its answer and its contribution.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    pub label: String,
    pub value: f64,
}

/// What to draw.
#[derive(Debug, Clone)]
pub struct Waterfall {
    pub title: String,
    /// E[f(X)]: the expected value (the bias column).
    pub base: f64,
    pub bars: Vec<Bar>,
    /// How many bars to show before folding the rest into "N other questions".
    pub max_bars: usize,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn fmt(v: f64) -> String {
    format!("{v:+.3}")
}

impl Waterfall {
    /// The bars to draw, largest |value| first, the rest folded into one.
    pub fn shown(&self) -> Vec<Bar> {
        let mut bars = self.bars.clone();
        bars.sort_by(|a, b| b.value.abs().total_cmp(&a.value.abs()));
        let keep = self.max_bars.max(1);
        if bars.len() > keep {
            let rest = bars.split_off(keep - 1);
            bars.push(Bar {
                label: format!("{} other questions", rest.len()),
                value: rest.iter().map(|b| b.value).sum(),
            });
        }
        bars
    }

    /// The prediction f(x) = base + sum of contributions.
    pub fn prediction(&self) -> f64 {
        self.base + self.bars.iter().map(|b| b.value).sum::<f64>()
    }

    /// Renders the chart as an SVG document.
    pub fn svg(&self) -> String {
        let bars = self.shown();
        let (w, label_w, row_h, top, bottom) = (900.0, 300.0, 34.0, 70.0, 70.0);
        let plot_l = label_w + 20.0;
        let plot_r = w - 40.0;
        let h = top + bottom + row_h * bars.len() as f64;
        // Cumulative positions from the base upward: the bottom bar starts at the base.
        let mut ends = Vec::with_capacity(bars.len());
        let mut acc = self.base;
        for b in bars.iter().rev() {
            let start = acc;
            acc += b.value;
            ends.push((start, acc));
        }
        ends.reverse();
        let (mut lo, mut hi) = (self.base.min(acc), self.base.max(acc));
        for (s, e) in &ends {
            lo = lo.min(s.min(*e));
            hi = hi.max(s.max(*e));
        }
        let pad = ((hi - lo) * 0.08).max(1e-6);
        let (lo, hi) = (lo - pad, hi + pad);
        let sx = |v: f64| plot_l + (v - lo) / (hi - lo) * (plot_r - plot_l);
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
             viewBox=\"0 0 {w} {h}\" font-family=\"DejaVu Sans, Arial, sans-serif\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
             <text x=\"{}\" y=\"32\" font-size=\"20\" font-weight=\"bold\" fill=\"#222\">{}</text>\n",
            20.0,
            esc(&self.title)
        );
        // Axis ticks.
        let axis_y = top + row_h * bars.len() as f64 + 8.0;
        s.push_str(&format!(
            "<line x1=\"{plot_l}\" y1=\"{axis_y}\" x2=\"{plot_r}\" y2=\"{axis_y}\" stroke=\"#666\"/>\n"
        ));
        for i in 0..=5 {
            let v = lo + (hi - lo) * i as f64 / 5.0;
            let x = sx(v);
            s.push_str(&format!(
                "<line x1=\"{x:.1}\" y1=\"{axis_y}\" x2=\"{x:.1}\" y2=\"{}\" stroke=\"#666\"/>\
                 <text x=\"{x:.1}\" y=\"{}\" font-size=\"13\" text-anchor=\"middle\" fill=\"#444\">{v:.2}</text>\n\
                 <line x1=\"{x:.1}\" y1=\"{top}\" x2=\"{x:.1}\" y2=\"{axis_y}\" stroke=\"#eee\"/>\n",
                axis_y + 5.0,
                axis_y + 22.0
            ));
        }
        // f(x) marker at the top and E[f(X)] at the bottom.
        let fx = sx(acc);
        let ex = sx(self.base);
        s.push_str(&format!(
            "<line x1=\"{fx:.1}\" y1=\"{}\" x2=\"{fx:.1}\" y2=\"{top}\" stroke=\"#888\" stroke-dasharray=\"4 3\"/>\
             <text x=\"{fx:.1}\" y=\"{}\" font-size=\"14\" text-anchor=\"middle\" fill=\"#222\">f(x) = {:.3}</text>\n\
             <line x1=\"{ex:.1}\" y1=\"{top}\" x2=\"{ex:.1}\" y2=\"{}\" stroke=\"#888\" stroke-dasharray=\"4 3\"/>\
             <text x=\"{ex:.1}\" y=\"{}\" font-size=\"14\" text-anchor=\"middle\" fill=\"#222\">E[f(X)] = {:.3}</text>\n",
            top - 12.0,
            top - 16.0,
            acc,
            axis_y,
            axis_y + 44.0,
            self.base
        ));
        for (i, (b, (start, end))) in bars.iter().zip(&ends).enumerate() {
            let y = top + row_h * i as f64;
            let (x0, x1) = (sx(start.min(*end)), sx(start.max(*end)));
            let colour = if b.value >= 0.0 { "#ff0051" } else { "#008bfb" };
            let bw = (x1 - x0).max(1.0);
            // Arrow-shaped bar: a rect with a pointed end in the direction of the change.
            let tip = 8.0f64.min(bw);
            let (y0, y1, ym) = (y + 5.0, y + row_h - 5.0, y + row_h / 2.0);
            let path = if b.value >= 0.0 {
                format!(
                    "M{x0:.1},{y0} L{:.1},{y0} L{x1:.1},{ym} L{:.1},{y1} L{x0:.1},{y1} Z",
                    x1 - tip,
                    x1 - tip
                )
            } else {
                format!(
                    "M{x1:.1},{y0} L{:.1},{y0} L{x0:.1},{ym} L{:.1},{y1} L{x1:.1},{y1} Z",
                    x0 + tip,
                    x0 + tip
                )
            };
            s.push_str(&format!("<path d=\"{path}\" fill=\"{colour}\"/>\n"));
            // Value text beside the bar, on the side with room.
            let (tx, anchor) = if x1 + 70.0 < plot_r {
                (x1 + 6.0, "start")
            } else {
                (x0 - 6.0, "end")
            };
            s.push_str(&format!(
                "<text x=\"{tx:.1}\" y=\"{:.1}\" font-size=\"14\" text-anchor=\"{anchor}\" fill=\"{colour}\">{}</text>\n",
                ym + 5.0,
                fmt(b.value)
            ));
            s.push_str(&format!(
                "<text x=\"{label_w}\" y=\"{:.1}\" font-size=\"14\" text-anchor=\"end\" fill=\"#333\">{}</text>\n\
                 <line x1=\"{plot_l}\" y1=\"{:.1}\" x2=\"{plot_r}\" y2=\"{:.1}\" stroke=\"#ddd\" stroke-dasharray=\"2 3\"/>\n",
                ym + 5.0,
                esc(&b.label),
                y + row_h,
                y + row_h
            ));
        }
        s.push_str("</svg>\n");
        s
    }

    /// Writes `<stem>.svg` and, in a build with the `png` feature, `<stem>.png` (PNG at 1x
    /// scale); returns the paths written.
    pub fn write(&self, stem: &Path) -> Result<Vec<std::path::PathBuf>, JudgeError> {
        let svg = self.svg();
        let svg_path = stem.with_extension("svg");
        std::fs::write(&svg_path, &svg).map_err(JudgeError::io(&svg_path))?;
        #[cfg(feature = "png")]
        {
            let png_path = stem.with_extension("png");
            let png = rasterise(&svg)?;
            std::fs::write(&png_path, png).map_err(JudgeError::io(&png_path))?;
            Ok(vec![svg_path, png_path])
        }
        #[cfg(not(feature = "png"))]
        Ok(vec![svg_path])
    }
}

/// Rasterises an SVG document to PNG bytes with resvg and the system fonts (the `png`
/// feature: resvg, its font stack and PNG encoder are a fifth of a clean build, and the SVG
/// serves every page and report).
#[cfg(feature = "png")]
pub fn rasterise(svg: &str) -> Result<Vec<u8>, JudgeError> {
    use resvg::{tiny_skia, usvg};
    let mut opt = usvg::Options::default();
    opt.fontdb_mut().load_system_fonts();
    let tree = usvg::Tree::from_str(svg, &opt)
        .map_err(|e| JudgeError::Encode(format!("parsing the chart SVG: {e}")))?;
    let size = tree.size().to_int_size();
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height())
        .ok_or_else(|| JudgeError::Encode("empty chart".into()))?;
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    pixmap
        .encode_png()
        .map_err(|e| JudgeError::Encode(format!("encoding the chart PNG: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folds_small_bars_and_keeps_the_sum() {
        let w = Waterfall {
            title: "t".into(),
            base: 3.0,
            bars: (0..6)
                .map(|i| Bar {
                    label: format!("q{i} <yes>"),
                    value: (i as f64 - 2.5) / 10.0,
                })
                .collect(),
            max_bars: 4,
        };
        let shown = w.shown();
        assert_eq!(shown.len(), 4);
        assert_eq!(shown[3].label, "3 other questions");
        let sum: f64 = shown.iter().map(|b| b.value).sum();
        assert!((w.base + sum - w.prediction()).abs() < 1e-12);
        let svg = w.svg();
        assert!(svg.contains("q0 &lt;yes&gt;"));
        assert!(svg.contains("E[f(X)] = 3.000"));
    }
}
