//! The page: one HTML string with its styles, script and plots inline.
//!
//! Every piece of user text (test names, inputs, responses, labels, paths) goes through
//! [`esc`]: responses are model output and may contain `<script>`. Results are grouped by
//! capability in `<details>` (closed when the run is large) and a small inline script
//! filters rows by test name, so the page stays readable at 10,000 tests.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use super::plots::{self, CellGuides, VERDICT_COLOURS, css};
use super::{CompareRow, Example, Report, ReportError};
use crate::stages::aggregate::{
    ALL_VERDICTS, ResultRow, UNCLUSTERED_NOTE, interval_cell, pct, validity_summary,
};
use crate::stages::score::MetricKind;

/// Test-level rows above which the capability sections start closed.
pub const OPEN_LIMIT: usize = 300;

/// Size of a forest-plot cell and of a validity bar, in pixels.
const CELL: (u32, u32) = (220, 18);
const BAR: (u32, u32) = (120, 12);

/// Escapes text for HTML content and attribute values.
///
/// # Example
/// ```
/// assert_eq!(evalflow::report::html::esc("<b a='1'>&"), "&lt;b a=&#39;1&#39;&gt;&amp;");
/// ```
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// A float for a `data-*` attribute: shortest round-trip text, empty when absent.
fn num(x: Option<f64>) -> String {
    x.map(|v| v.to_string()).unwrap_or_default()
}

/// Cuts `s` to [`super::EXAMPLE_CHARS`] characters, marking the cut.
fn clip(s: &str) -> String {
    if s.chars().count() > super::EXAMPLE_CHARS {
        let mut t: String = s.chars().take(super::EXAMPLE_CHARS).collect();
        t.push('…');
        t
    } else {
        s.to_string()
    }
}

const STYLE: &str = r#"
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1240px;padding:12px 20px;color:#222;background:#fff}
h1{font-size:22px;margin:4px 0}h2{font-size:18px;margin:22px 0 6px;border-bottom:1px solid #ddd}h3{font-size:15px;margin:12px 0 4px}
.banner{background:#c0392b;color:#fff;padding:8px 12px;margin:8px 0;border-radius:4px;font-weight:600}
.ok{background:#e8f5e9;color:#1b5e20;padding:6px 12px;margin:8px 0;border-radius:4px}
dl.meta{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:6px 0}dl.meta dt{color:#666}dl.meta dd{margin:0}
table{border-collapse:collapse;margin:4px 0 10px}table.forest{width:100%}td.ci{white-space:nowrap}
th,td{padding:2px 8px;text-align:left;vertical-align:middle;border-bottom:1px solid #eee}
th{background:#f6f6f6;font-weight:600;position:sticky;top:0}td.n{text-align:right;font-variant-numeric:tabular-nums}
tr.cap td{font-weight:600;background:#fafafa}td svg{display:block}
.legend span{display:inline-block;margin-right:12px;font-size:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
details.cap{border:1px solid #ddd;border-radius:4px;margin:6px 0;padding:2px 8px}details.cap>summary{cursor:pointer;font-weight:600;padding:4px 0}
details.ex summary{cursor:pointer;color:#1f3a93;font-size:12px}.ex table{font-size:12px;margin-left:16px}
.ex td{max-width:520px;white-space:pre-wrap;word-break:break-word}
.muted{color:#777;font-size:12px}#q{font-size:14px;padding:4px 8px;width:320px}.hists{display:flex;flex-wrap:wrap;gap:10px}
.fail{color:#c0392b;font-weight:600}.pass{color:#2e7d32}
"#;

const SCRIPT: &str = r#"
(function(){
window.addEventListener('load',function(){document.documentElement.setAttribute('data-load-ms',Math.round(performance.now()));});
function fill(d){var t=d.querySelector('script[type="text/html"]');if(t){d.insertAdjacentHTML('beforeend',t.textContent);t.remove();}}
var ds=document.querySelectorAll('details.cap');
ds.forEach(function(d){d.addEventListener('toggle',function(){if(d.open)fill(d);});});
var q=document.getElementById('q');if(!q)return;
q.addEventListener('input',function(){var s=q.value.trim().toLowerCase();
ds.forEach(function(d){var n=d.getAttribute('data-names');
if(s&&n!==null&&n.toLowerCase().indexOf(s)<0){d.hidden=true;return;}
if(s)fill(d);var any=!s;
d.querySelectorAll('tr[data-test]').forEach(function(r){var m=!s||r.getAttribute('data-test').toLowerCase().indexOf(s)>=0;
r.hidden=!m;if(m&&r.classList.contains('r'))any=true;});
d.hidden=!any;if(s&&any)d.open=true;});});})();
"#;

/// Renders the page.
///
/// # Errors
/// A plot cannot be drawn.
pub fn render(r: &Report) -> Result<String, ReportError> {
    let mut o = String::with_capacity(64 * 1024 + r.rows.len() * 2048);
    let m = &r.manifest;
    let _ = write!(
        o,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>evalflow report: {}</title><style>{STYLE}</style></head><body>",
        esc(&m.run_id)
    );
    header(&mut o, r)?;
    results(&mut o, r)?;
    if let Some(c) = &r.comparison {
        comparison(&mut o, c)?;
    }
    if let Some(h) = &r.holdout {
        holdout(&mut o, h)?;
    }
    if let Some(j) = &r.judge {
        judge(&mut o, j);
    }
    calls(&mut o, r)?;
    let _ = write!(
        o,
        "<p class=\"muted\">evalflow {} · generated {}</p><script>{SCRIPT}</script></body></html>",
        esc(env!("CARGO_PKG_VERSION")),
        esc(&crate::storage::manifest_now())
    );
    Ok(o)
}

fn legend(o: &mut String, parts: &[(String, i64)]) {
    let total: i64 = parts.iter().map(|p| p.1).sum();
    o.push_str("<div class=\"legend\">");
    for (i, (name, n)) in parts.iter().enumerate().filter(|(_, p)| p.1 > 0) {
        let c = VERDICT_COLOURS[i.min(VERDICT_COLOURS.len() - 1)];
        let _ = write!(
            o,
            "<span><i style=\"background:{}\"></i>{} {} ({:.1}%)</span>",
            css(c),
            esc(name),
            n,
            *n as f64 * 100.0 / total.max(1) as f64
        );
    }
    o.push_str("</div>");
}

fn header(o: &mut String, r: &Report) -> Result<(), ReportError> {
    let m = &r.manifest;
    let _ = write!(
        o,
        "<header><h1>evalflow report: run {}</h1>",
        esc(&m.run_id)
    );
    if !r.incomplete.is_empty() {
        let _ = write!(
            o,
            "<div class=\"banner\" id=\"incomplete\">Run incomplete: {}. Not a lower number: a run that did not complete.</div>",
            esc(&r.incomplete.join("; "))
        );
    }
    if let Some(g) = &r.gate {
        let text = format!(
            "invalid fraction {:.1}% vs baseline {:.1}% (run {}, {}): drift {:+.1} pp, limit {:.1} pp",
            g.invalid * 100.0,
            g.baseline_invalid * 100.0,
            g.baseline_run,
            g.baseline_file,
            g.drift_pp(),
            g.max_drift_pp
        );
        if g.failed() {
            let _ = write!(
                o,
                "<div class=\"banner\" id=\"gate\">Invalid-rate gate failed: {}. Not a lower number: a run that did not complete.</div>",
                esc(&text)
            );
        } else {
            let _ = write!(
                o,
                "<div class=\"ok\" id=\"gate\">Invalid-rate gate passed: {}</div>",
                esc(&text)
            );
        }
    }
    let models = r
        .models
        .iter()
        .map(|(m, n)| format!("{m} ({n} calls)"))
        .collect::<Vec<_>>()
        .join(", ");
    let stages = super::STAGES
        .iter()
        .map(|s| {
            // An imported run's generate and call ran in another tool: say so, rather
            // than claim evalflow generated and called them.
            let st = m
                .stages
                .get(*s)
                .map(|x| {
                    if x.details.contains_key("imported_from") {
                        "imported".to_string()
                    } else {
                        format!("{:?}", x.status).to_lowercase()
                    }
                })
                .unwrap_or_else(|| "missing".into());
            format!("{s} {st}")
        })
        .collect::<Vec<_>>()
        .join(", ");
    let rows: [(&str, String); 12] = [
        ("run root", r.root.clone()),
        (
            "pipeline",
            format!("{} (hash {})", m.pipeline_path, m.pipeline_hash),
        ),
        ("models", models),
        ("reported scorer", r.scorer.tag()),
        ("scorer versions", m.scorer_versions.join(", ")),
        (
            "validator",
            m.validator_version.clone().unwrap_or_else(|| "-".into()),
        ),
        ("cases", r.n_cases.to_string()),
        ("calls", r.n_calls().to_string()),
        ("tokens and cost", tokens_and_cost(m)),
        ("created", m.created_at.clone()),
        (
            "finished",
            m.finished_at.clone().unwrap_or_else(|| "-".into()),
        ),
        ("stages", stages),
    ];
    o.push_str("<dl class=\"meta\">");
    for (k, v) in rows {
        let _ = write!(o, "<dt>{k}</dt><dd>{}</dd>", esc(&v));
    }
    o.push_str("</dl>");
    let _ = write!(
        o,
        "<h3>Validity of all {} calls (invalid {:.1}%)</h3>",
        r.n_calls(),
        r.invalid_fraction() * 100.0
    );
    let parts: Vec<(i64, plotters::style::RGBColor)> = r
        .validity
        .iter()
        .enumerate()
        .map(|(i, v)| (v.1, VERDICT_COLOURS[i.min(VERDICT_COLOURS.len() - 1)]))
        .collect();
    let _ = write!(
        o,
        "<div id=\"validity\">{}</div>",
        plots::stacked_bar(&parts, 900, 22)?
    );
    legend(o, &r.validity);
    o.push_str("</header>");
    Ok(())
}

/// The call stage's tokens, and their cost when `[model]` has a price (batch rows at the
/// batch discount), from the manifest.
fn tokens_and_cost(m: &crate::storage::Manifest) -> String {
    let Some(d) = m.stages.get("call").map(|s| &s.details) else {
        return "-".into();
    };
    let int = |k: &str| d.get(k).and_then(serde_json::Value::as_i64);
    let (Some(p), Some(c)) = (int("prompt_tokens"), int("completion_tokens")) else {
        return "-".into();
    };
    let mut s = format!("prompt {p}, completion {c}");
    let batch = (
        int("batch_prompt_tokens").unwrap_or(0),
        int("batch_completion_tokens").unwrap_or(0),
    );
    if batch != (0, 0) {
        s.push_str(&format!(
            " (through batches: prompt {}, completion {})",
            batch.0, batch.1
        ));
    }
    let usd = |k: &str| d.get(k).and_then(serde_json::Value::as_f64);
    if let (Some(paid), Some(full)) = (usd("cost_usd"), usd("cost_usd_without_batch_discount")) {
        s.push_str(&format!("; cost ${paid:.6}"));
        if paid < full {
            s.push_str(&format!(" (${full:.6} without the batch discount)"));
        }
    }
    s
}

/// The axis range of the headline metric: [0, 1] for rates, the rows' span for means.
fn metric_range(kind: MetricKind, rows: &[ResultRow]) -> (f64, f64) {
    if kind != MetricKind::Numeric {
        return (0.0, 1.0);
    }
    let vals = rows
        .iter()
        .flat_map(|r| [r.ci_lo, r.value, r.ci_hi])
        .flatten()
        .filter(|v| v.is_finite());
    let (lo, hi) = vals.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
        (a.min(v), b.max(v))
    });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.05).max(1e-3);
    (lo - pad, hi + pad)
}

fn metric_title(kind: MetricKind) -> &'static str {
    match kind {
        MetricKind::PassFail => "failure rate",
        MetricKind::Label => "rate of each label",
        MetricKind::Numeric => "mean score",
    }
}

/// The header cells of a results table.
fn result_head(o: &mut String, kind: MetricKind, first: &str, axis: &str) {
    let _ = write!(o, "<thead><tr><th>{first}</th><th>type</th><th>model</th>");
    match kind {
        MetricKind::PassFail => {
            o.push_str("<th>n</th><th>templates</th><th>fail</th><th>fail rate</th><th>95% CI</th>")
        }
        MetricKind::Label => o.push_str(
            "<th>label</th><th>n</th><th>templates</th><th>count</th><th>rate</th><th>95% CI</th>",
        ),
        MetricKind::Numeric => {
            o.push_str("<th>n</th><th>templates</th><th>mean</th><th>95% CI</th>")
        }
    }
    let _ = write!(
        o,
        "<th>method</th><th>{axis}</th><th>validity</th></tr></thead>"
    );
}

/// One results row: the same numbers as the text table, the values as `data-*` attributes,
/// a forest-plot cell and a validity bar.
fn result_row(
    o: &mut String,
    kind: MetricKind,
    r: &ResultRow,
    range: (f64, f64),
) -> Result<(), ReportError> {
    let name = r.test.clone().unwrap_or_else(|| r.capability.clone());
    let validity_csv = r
        .validity
        .iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let _ = write!(
        o,
        "<tr class=\"r{}\" data-test=\"{}\" data-level=\"{}\" data-capability=\"{}\" data-test-type=\"{}\" \
         data-model=\"{}\" data-metric=\"{}\" data-label=\"{}\" data-n=\"{}\" data-hits=\"{}\" data-value=\"{}\" \
         data-se=\"{}\" data-ci-lo=\"{}\" data-ci-hi=\"{}\" data-ci-method=\"{}\" data-n-templates=\"{}\" \
         data-clustered=\"{}\" data-n-rows=\"{}\" data-validity=\"{}\" data-validity-other=\"{}\">",
        if r.level == "capability" { " cap" } else { "" },
        esc(&name),
        esc(&r.level),
        esc(&r.capability),
        esc(&r.test_type),
        esc(&r.model),
        esc(&r.metric),
        esc(r.label.as_deref().unwrap_or("")),
        r.n,
        r.hits.map(|h| h.to_string()).unwrap_or_default(),
        num(r.value),
        num(r.se),
        num(r.ci_lo),
        num(r.ci_hi),
        esc(&r.ci_method),
        r.n_templates,
        r.clustered,
        r.n_rows,
        validity_csv,
        r.validity_other
    );
    let _ = write!(
        o,
        "<td>{}</td><td>{}</td><td>{}</td>",
        esc(&name),
        esc(&r.test_type),
        esc(&r.model)
    );
    let ci = |as_pct| esc(&interval_cell(r, as_pct));
    match kind {
        MetricKind::PassFail => {
            let _ = write!(
                o,
                "<td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"ci\">{}</td>",
                r.n,
                r.n_templates,
                r.hits.unwrap_or(0),
                pct(r.value),
                ci(true)
            );
        }
        MetricKind::Label => {
            let _ = write!(
                o,
                "<td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"ci\">{}</td>",
                esc(r.label.as_deref().unwrap_or("-")),
                r.n,
                r.n_templates,
                r.hits.unwrap_or(0),
                pct(r.value),
                ci(true)
            );
        }
        MetricKind::Numeric => {
            let _ = write!(
                o,
                "<td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"ci\">{}</td>",
                r.n,
                r.n_templates,
                r.value
                    .map(|m| format!("{m:.3}"))
                    .unwrap_or_else(|| "-".into()),
                ci(false)
            );
        }
    }
    let method_title = r.note.as_deref().unwrap_or("");
    let _ = write!(
        o,
        "<td title=\"{}\">{}</td><td>{}</td>",
        esc(method_title),
        esc(&r.ci_method),
        plots::interval(
            r.value,
            r.ci_lo,
            r.ci_hi,
            range,
            CellGuides::default(),
            CELL
        )?
    );
    let mut parts: Vec<(i64, plotters::style::RGBColor)> = r
        .validity
        .iter()
        .zip(VERDICT_COLOURS)
        .map(|(n, c)| (*n, c))
        .collect();
    parts.push((r.validity_other, VERDICT_COLOURS[8]));
    let _ = write!(
        o,
        "<td title=\"{}\">{}</td></tr>",
        esc(&validity_summary(&r.validity, r.validity_other)),
        plots::stacked_bar(&parts, BAR.0, BAR.1)?
    );
    Ok(())
}

fn results(o: &mut String, r: &Report) -> Result<(), ReportError> {
    let kind = r.kind;
    let range = metric_range(kind, &r.rows);
    let as_pct = kind != MetricKind::Numeric;
    let axis = plots::axis(range, as_pct, (CELL.0, 22))?;
    let _ = write!(
        o,
        "<section id=\"results\"><h2>Results: {} of {} (95% interval clustered by template)</h2>\
         <p class=\"muted\">One row per test and model{}; the interval's method is beside it \
         (rows marked * have one template: {}). The bar on the right is the validity of the row's calls.</p>",
        metric_title(kind),
        esc(&r.scorer.tag()),
        if kind == MetricKind::Label {
            " and label"
        } else {
            ""
        },
        esc(UNCLUSTERED_NOTE)
    );
    o.push_str("<div class=\"legend\">");
    for (v, c) in ALL_VERDICTS.iter().zip(VERDICT_COLOURS) {
        let _ = write!(o, "<span><i style=\"background:{}\"></i>{v}</span>", css(c));
    }
    o.push_str("</div>");
    // Capability x test type: the summary rows, all models.
    o.push_str("<h3>Capability x test type</h3><table class=\"forest\" id=\"capabilities\">");
    result_head(o, kind, "capability", &axis);
    o.push_str("<tbody>");
    for row in r.rows.iter().filter(|x| x.level == "capability") {
        result_row(o, kind, row, range)?;
    }
    o.push_str("</tbody></table>");

    let n_tests = r.rows.iter().filter(|x| x.level == "test").count();
    let open = if n_tests <= OPEN_LIMIT { " open" } else { "" };
    let _ = write!(
        o,
        "<h3>Per test</h3><p><input id=\"q\" type=\"search\" placeholder=\"Search {n_tests} test rows by name\" \
         aria-label=\"search tests\"> <span class=\"muted\">{}</span></p>",
        if open.is_empty() {
            "sections are collapsed: open one, or search"
        } else {
            ""
        }
    );
    let mut examples: BTreeMap<(&str, &str), Vec<&Example>> = BTreeMap::new();
    for e in &r.examples {
        examples
            .entry((e.test.as_str(), e.test_type.as_str()))
            .or_default()
            .push(e);
    }
    let caps: BTreeSet<&str> = r
        .rows
        .iter()
        .filter(|x| x.level == "test")
        .map(|x| x.capability.as_str())
        .collect();
    let cols = match kind {
        MetricKind::Label => 13,
        _ => 12,
    };
    for cap in caps {
        let rows: Vec<&ResultRow> = r
            .rows
            .iter()
            .filter(|x| x.level == "test" && x.capability == cap)
            .collect();
        let tests: BTreeSet<&str> = rows.iter().filter_map(|x| x.test.as_deref()).collect();
        let mut body = String::new();
        let types: BTreeSet<&str> = rows.iter().map(|x| x.test_type.as_str()).collect();
        for ty in types {
            let _ = write!(
                body,
                "<h3>{} · {}</h3><table class=\"forest\">",
                esc(cap),
                esc(ty)
            );
            result_head(&mut body, kind, "test", &axis);
            body.push_str("<tbody>");
            let group: Vec<&&ResultRow> = rows.iter().filter(|x| x.test_type == ty).collect();
            let mut i = 0;
            while i < group.len() {
                let test = group[i].test.as_deref().unwrap_or("");
                let mut failures = None;
                while i < group.len() && group[i].test.as_deref().unwrap_or("") == test {
                    result_row(&mut body, kind, group[i], range)?;
                    if let Some(f) = group[i].failures() {
                        failures = Some(failures.unwrap_or(0) + f);
                    }
                    i += 1;
                }
                if let Some(ex) = examples.get(&(test, ty)) {
                    example_row(&mut body, kind, test, ex, failures, cols);
                }
            }
            body.push_str("</tbody></table>");
        }
        let names: Vec<&str> = tests.iter().copied().collect();
        let summary = format!(
            "{} <span class=\"muted\">{} tests</span>",
            esc(cap),
            tests.len()
        );
        section(o, cap, &summary, &names, !open.is_empty(), &body);
    }
    o.push_str("</section>");
    Ok(())
}

/// One collapsible capability section. A small page has its rows inline and open; a large one
/// keeps each section's rows as inert text (`<script type="text/html">`, which the browser
/// does not parse) until the section is opened or a search matches one of `names`, so the
/// page renders at once whatever the number of tests. User text in `body` is escaped, so it
/// cannot close the script element.
fn section(o: &mut String, cap: &str, summary: &str, names: &[&str], open: bool, body: &str) {
    if open {
        let _ = write!(
            o,
            "<details class=\"cap\" data-capability=\"{}\" open><summary>{summary}</summary>{body}</details>",
            esc(cap)
        );
    } else {
        let _ = write!(
            o,
            "<details class=\"cap\" data-capability=\"{}\" data-names=\"{}\"><summary>{summary}</summary>\
             <script type=\"text/html\">{body}</script></details>",
            esc(cap),
            esc(&names.join("\n"))
        );
    }
}

fn verdict(kind: MetricKind, e: &Example) -> String {
    let scored = match kind {
        MetricKind::PassFail => match e.passed.as_deref() {
            Some("false") => "<span class=\"fail\">fail</span>".to_string(),
            Some("true") => "<span class=\"pass\">pass</span>".to_string(),
            _ => "not scored".to_string(),
        },
        MetricKind::Label => format!("label {}", esc(e.label.as_deref().unwrap_or("-"))),
        MetricKind::Numeric => format!("score {}", esc(e.score.as_deref().unwrap_or("-"))),
    };
    format!("{scored} ({})", esc(&e.validity))
}

fn answer(resp: Option<&str>, score: Option<&str>) -> String {
    let mut s = esc(&clip(resp.unwrap_or("(no response)")));
    if let Some(x) = score {
        let _ = write!(s, " <span class=\"muted\">score {}</span>", esc(x));
    }
    s
}

/// The summary of a test's examples: how many are shown and, for failures, of how many
/// (`3 of 46 failures in T`, `1 failure in T`), singular or plural by the count it names.
pub(crate) fn examples_summary(
    kind: MetricKind,
    test: &str,
    shown: usize,
    failures: Option<i64>,
) -> String {
    let word = |n: u64, one: &str, many: &str| {
        if n == 1 {
            one.to_string()
        } else {
            many.to_string()
        }
    };
    let shown_n = shown as u64;
    let (count, what) = match (kind, failures) {
        (MetricKind::PassFail, Some(t)) if t > shown as i64 => (
            format!("{shown} of {t}"),
            word(t as u64, "failure", "failures"),
        ),
        (MetricKind::PassFail, _) => (shown.to_string(), word(shown_n, "failure", "failures")),
        (MetricKind::Numeric, _) => (
            shown.to_string(),
            word(shown_n, "lowest score", "lowest scores"),
        ),
        (MetricKind::Label, _) => (shown.to_string(), word(shown_n, "example", "examples")),
    };
    format!("{count} {what} in {test}")
}

fn example_row(
    o: &mut String,
    kind: MetricKind,
    test: &str,
    ex: &[&Example],
    failures: Option<i64>,
    cols: usize,
) {
    let _ = write!(
        o,
        "<tr class=\"ex\" data-test=\"{}\"><td colspan=\"{cols}\"><details class=\"ex\"><summary>{}</summary><table>\
         <tbody>",
        esc(test),
        esc(&examples_summary(kind, test, ex.len(), failures))
    );
    for e in ex {
        let expected = e
            .expected
            .clone()
            .or_else(|| e.expectation.clone())
            .unwrap_or_else(|| {
                if e.base_input.is_some() {
                    "same as base (within tolerance)".into()
                } else {
                    "-".into()
                }
            });
        if let Some(bi) = &e.base_input {
            let _ = write!(
                o,
                "<tr><td>{}</td><td><b>base:</b> {}</td><td>{}</td><td rowspan=\"2\">expected: {}</td><td rowspan=\"2\">{}</td></tr>\
                 <tr><td></td><td><b>perturbed:</b> {}</td><td>{}</td></tr>",
                esc(&e.model),
                esc(&clip(bi)),
                answer(e.base_response.as_deref(), e.base_response_score.as_deref()),
                esc(&expected),
                verdict(kind, e),
                esc(&clip(&e.input)),
                answer(e.response.as_deref(), e.response_score.as_deref()),
            );
        } else {
            let _ = write!(
                o,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>expected: {}</td><td>{}</td></tr>",
                esc(&e.model),
                esc(&clip(&e.input)),
                answer(e.response.as_deref(), e.response_score.as_deref()),
                esc(&expected),
                verdict(kind, e),
            );
        }
    }
    o.push_str("</tbody></table></details></td></tr>");
}

fn opt(x: Option<f64>, digits: usize) -> String {
    x.map(|v| format!("{v:.digits$}"))
        .unwrap_or_else(|| "-".into())
}

fn compare_row(o: &mut String, c: &CompareRow, range: (f64, f64)) -> Result<(), ReportError> {
    let name = if c.scope == "test" {
        c.test.clone()
    } else {
        c.capability.clone()
    };
    let _ = write!(
        o,
        "<tr class=\"r{}\" data-test=\"{}\" data-scope=\"{}\" data-capability=\"{}\" data-diff=\"{}\" data-lo=\"{}\" \
         data-hi=\"{}\" data-mde=\"{}\" data-unpaired=\"{}\"><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td \
             class=\"n\">{}</td><td class=\"n\">{}</td>\
         <td class=\"n\">{}</td><td class=\"n\">{}</td><td>[{}, {}]</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td><td>{}</td></tr>",
        if c.scope == "test" { "" } else { " cap" },
        esc(&name),
        esc(&c.scope),
        esc(&c.capability),
        num(c.diff),
        num(c.lo),
        num(c.hi),
        num(c.mde),
        c.n_unpaired.unwrap_or(0),
        esc(&name),
        c.n_cases.map(|n| n.to_string()).unwrap_or_default(),
        c.n_unpaired.map(|n| n.to_string()).unwrap_or_default(),
        c.n_templates.map(|n| n.to_string()).unwrap_or_default(),
        opt(c.mean_a, 3),
        opt(c.mean_b, 3),
        opt(c.diff, 4),
        opt(c.lo, 4),
        opt(c.hi, 4),
        opt(c.mde, 4),
        opt(c.p_value, 4),
        plots::interval(
            c.diff,
            c.lo,
            c.hi,
            range,
            CellGuides {
                band: c.mde.map(|m| (-m, m)),
                reference: Some(0.0),
                marker: None,
            },
            CELL
        )?,
        esc(&c.verdict)
    );
    Ok(())
}

fn comparison(o: &mut String, c: &super::Comparison) -> Result<(), ReportError> {
    let span = c
        .rows
        .iter()
        .flat_map(|r| [r.lo, r.hi, r.mde, r.diff])
        .flatten()
        .filter(|v| v.is_finite())
        .fold(0.0f64, |a, v| a.max(v.abs()))
        .max(0.01)
        * 1.1;
    let range = (-span, span);
    let axis = plots::axis(range, false, (CELL.0, 22))?;
    let head = format!(
        "<thead><tr><th>scope</th><th>pairs</th><th>unpaired</th><th>templates</th><th>mean A</th><th>mean B</th><th>B − A</th>\
         <th>95% CI (clustered)</th><th>MDE</th><th>p</th><th>{axis}</th><th>verdict</th></tr></thead>"
    );
    let overall = c
        .rows
        .iter()
        .find(|r| r.scope == "overall")
        .map(|r| r.verdict.clone())
        .unwrap_or_else(|| "could not tell".into());
    let _ = write!(
        o,
        "<section id=\"compare\"><h2>Comparison: B − A, paired on cases</h2>\
         <dl class=\"meta\"><dt>A</dt><dd>{}</dd><dt>B</dt><dd>{}</dd><dt>scorer</dt><dd>{}</dd>\
         <dt>overall</dt><dd id=\"verdict\"><b>{}</b></dd></dl>\
         <p class=\"muted\">Mean score of B minus A per case (K samples averaged) over the cases scored in both \
         runs (a case scored in one run only is counted as unpaired and left out of every number), standard error \
         clustered by template; the shaded band is ± the minimum detectable effect (alpha 0.05, power 0.8). An interval \
         inside the band that crosses zero is not evidence of no change.</p><table class=\"forest\">{head}<tbody>",
        esc(&c.run_a),
        esc(&c.run_b),
        esc(&c.scorer),
        esc(&overall)
    );
    for r in c.rows.iter().filter(|r| r.scope != "test") {
        compare_row(o, r, range)?;
    }
    o.push_str("</tbody></table>");
    let caps: BTreeSet<&str> = c
        .rows
        .iter()
        .filter(|r| r.scope == "test")
        .map(|r| r.capability.as_str())
        .collect();
    let n_tests = c.rows.iter().filter(|r| r.scope == "test").count();
    let open = if n_tests <= OPEN_LIMIT { " open" } else { "" };
    for cap in caps {
        let mut body = format!("<table class=\"forest\">{head}<tbody>");
        let rows: Vec<&CompareRow> = c
            .rows
            .iter()
            .filter(|r| r.scope == "test" && r.capability == cap)
            .collect();
        for r in &rows {
            compare_row(&mut body, r, range)?;
        }
        body.push_str("</tbody></table>");
        let names: Vec<&str> = rows.iter().map(|r| r.test.as_str()).collect();
        let summary = format!("{} <span class=\"muted\">per test</span>", esc(cap));
        section(o, cap, &summary, &names, !open.is_empty(), &body);
    }
    o.push_str("</section>");
    Ok(())
}

/// The judge GBDT's predictions with conformal intervals, and one unit's SHAP waterfall.
fn judge(o: &mut String, j: &super::JudgeSection) {
    let _ = write!(
        o,
        "<section id=\"judge\"><h2>Judge: learned aggregation of the checklist</h2>\
         <p class=\"muted\">GBDT {} over the answers of {}; each prediction has a split-conformal interval \
         at {:.0}% coverage. {} observations, the first {} listed.</p>\
         <table class=\"judge\"><thead><tr><th>unit</th><th>judge</th><th>trial</th><th>split</th>\
         <th>prediction</th><th>conformal interval</th></tr></thead><tbody>",
        esc(&j.model_file),
        esc(&j.checklist),
        j.coverage_level * 100.0,
        j.n_obs,
        j.predictions.len()
    );
    for p in &j.predictions {
        let _ = write!(
            o,
            "<tr data-unit=\"{}\" data-prediction=\"{}\" data-lo=\"{}\" data-hi=\"{}\"><td>{}</td><td>{}</td>\
             <td class=\"n\">{}</td><td>{}</td><td class=\"n\">{:.3}</td><td>[{:.3}, {:.3}]</td></tr>",
            esc(&p.unit),
            p.prediction,
            p.lo,
            p.hi,
            esc(&p.unit),
            esc(&p.judge),
            p.trial,
            esc(&p.split),
            p.prediction,
            p.lo,
            p.hi
        );
    }
    // The waterfall is evalflow's own SVG (labels escaped where it is drawn); drop an XML
    // prologue, if any, so it embeds as an element.
    let svg = j
        .waterfall_svg
        .find("<svg")
        .map_or("", |i| &j.waterfall_svg[i..]);
    let _ = write!(
        o,
        "</tbody></table><h3>Why unit {} got its prediction (SHAP)</h3><div class=\"waterfall\">{svg}</div></section>",
        esc(&j.unit)
    );
}

fn holdout(o: &mut String, h: &super::Holdout) -> Result<(), ReportError> {
    let axis = plots::axis((0.0, 1.0), true, (CELL.0, 22))?;
    let _ = write!(
        o,
        "<section id=\"holdout\"><h2>Class rates corrected for the scorer's error (Rogan-Gladen)</h2>\
         <p class=\"muted\">{} hand-labelled calls from {}; the hollow marker is the raw rate, the interval the \
         corrected rate's 95% delta-method interval.</p><table class=\"forest\"><thead><tr><th>class</th><th>rows</th>\
         <th>raw rate</th><th>corrected</th><th>95% CI</th><th>sens / spec</th><th>{axis}</th></tr></thead><tbody>",
        h.labelled,
        esc(&h.file)
    );
    for p in &h.rows {
        let raw = p.pos as f64 / p.n.max(1) as f64;
        let sens = p.tp as f64 / (p.tp + p.fn_).max(1) as f64;
        let spec = p.tn as f64 / (p.tn + p.fp).max(1) as f64;
        let c = p.corrected;
        let _ = write!(
            o,
            "<tr data-class=\"{}\" data-raw=\"{raw}\" data-corrected=\"{}\"><td>{}</td><td class=\"n\">{} / {}</td>\
             <td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td><td>{:.0}% / {:.0}%</td><td>{}</td></tr>",
            esc(&p.class),
            num(c.map(|c| c[0])),
            esc(&p.class),
            p.pos,
            p.n,
            pct(Some(raw)),
            c.map(|c| pct(Some(c[0])))
                .unwrap_or_else(|| "- (sens + spec <= 1)".into()),
            c.map(|c| format!("[{}, {}]", pct(Some(c[2])), pct(Some(c[3]))))
                .unwrap_or_else(|| "-".into()),
            sens * 100.0,
            spec * 100.0,
            plots::interval(
                c.map(|c| c[0]),
                c.map(|c| c[2]),
                c.map(|c| c[3]),
                (0.0, 1.0),
                CellGuides {
                    marker: Some(raw),
                    ..Default::default()
                },
                CELL
            )?
        );
    }
    o.push_str("</tbody></table></section>");
    Ok(())
}

fn calls(o: &mut String, r: &Report) -> Result<(), ReportError> {
    o.push_str("<section id=\"calls\"><h2>Calls: answer length, latency, finish reasons</h2>");
    for (model, _) in &r.models {
        let _ = write!(o, "<h3>{}</h3><div class=\"hists\">", esc(model));
        if let Some((_, bins)) = r.answer_chars.iter().find(|x| &x.0 == model) {
            let _ = write!(
                o,
                "<div>{}</div>",
                plots::histogram(
                    bins,
                    "answer length (characters)",
                    VERDICT_COLOURS[0],
                    (400, 200)
                )?
            );
        }
        // Imported calls often carry no latency: no chart then, never an empty one.
        match r.latency.iter().find(|x| &x.0 == model) {
            Some((_, bins)) if bins.iter().any(|(_, n)| *n > 0) => {
                let _ = write!(
                    o,
                    "<div>{}</div>",
                    plots::histogram(bins, "latency", RGBA_LATENCY, (400, 200))?
                );
            }
            _ => o.push_str(
                "<div class=\"muted no-latency\">no latency recorded for these calls</div>",
            ),
        }
        o.push_str(
            "<div><table><thead><tr><th>finish_reason</th><th>calls</th></tr></thead><tbody>",
        );
        for (_, reason, n) in r.finish_reasons.iter().filter(|f| &f.0 == model) {
            let _ = write!(
                o,
                "<tr><td>{}</td><td class=\"n\">{n}</td></tr>",
                esc(reason)
            );
        }
        o.push_str("</tbody></table></div></div>");
    }
    o.push_str("</section>");
    Ok(())
}

const RGBA_LATENCY: plotters::style::RGBColor = plotters::style::RGBColor(31, 58, 147);
