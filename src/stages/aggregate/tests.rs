//! Unit tests of the aggregate stage (in their own file: aggregate.rs stays under
//! tests/layers.rs's 1,000 lines).

use super::*;

#[test]
fn wilson_is_not_degenerate_at_zero() {
    let (lo, hi) = wilson(0.0, 20.0, 1.959963984540054);
    assert_eq!(lo, 0.0);
    assert!((hi - 0.16113).abs() < 1e-4, "{hi}");
}

#[test]
fn one_template_is_marked_unclustered() {
    let mut r = ResultRow::default();
    let st = Stats {
        n: 10,
        sum: 3.0,
        n_templates: 1,
        se: None,
        lo: None,
        hi: None,
        method: Some("cr2_score".into()),
        naive_se: Some(0.152_752_523_165_194_67),
    };
    finish(&mut r, MetricKind::PassFail, &st);
    assert!(!r.clustered);
    assert_eq!(r.note.as_deref(), Some(UNCLUSTERED_NOTE));
    assert_eq!(r.ci_method, "wilson");
    let (lo, hi) = wilson(0.3, 10.0, Z95);
    assert_eq!((r.ci_lo, r.ci_hi), (Some(lo), Some(hi)));
    assert!(
        render(&[ResultRow {
            level: "capability".into(),
            metric: "failure_rate".into(),
            ..r
        }])
        .contains(UNCLUSTERED_NOTE)
    );
}

/// Issue 61, item 7: a clustered interval over few templates says why it is wide and what
/// narrows it (0 of 120 failures over 2 templates gave [0.0%, 57.4%] without a word); from
/// five templates on it says nothing.
#[test]
fn few_templates_are_marked_with_why_the_interval_is_wide() {
    for (templates, marked) in [(2, true), (4, true), (5, false), (20, false)] {
        let mut r = ResultRow::default();
        let st = Stats {
            n: 120,
            sum: 0.0,
            n_templates: templates,
            se: Some(0.0),
            lo: Some(0.0),
            hi: Some(0.574),
            method: Some("cr2_score".into()),
            naive_se: Some(0.0),
        };
        finish(&mut r, MetricKind::PassFail, &st);
        assert!(r.clustered);
        let page = render(&[ResultRow {
            level: "capability".into(),
            metric: "failure_rate".into(),
            model: "m".into(),
            ..r.clone()
        }]);
        if marked {
            assert_eq!(r.note, Some(few_templates_note(templates)));
            assert!(
                r.note.as_deref().unwrap().contains(&format!(
                    "{templates} templates: a clustered interval has at most {} degree(s)",
                    templates - 1
                )) && r.note.as_deref().unwrap().contains("evalflow plan")
            );
            assert!(
                interval_cell(&r, true).ends_with(" +"),
                "{}",
                interval_cell(&r, true)
            );
            assert!(page.contains("+ fewer than 5 templates"), "{page}");
        } else {
            // 0 failures is a rare rate: its own note, not the few-templates one.
            assert_eq!(r.note, Some(rare_rate_note(templates, "cr2_score")));
            assert!(!interval_cell(&r, true).contains('+'));
            assert!(!page.contains("+ fewer than"), "{page}");
        }
    }
}

/// Issue 63: a rate within 0.05 of 0 or 1 from fewer than 50 templates is flagged (` ^` and a
/// footnote) unless its interval honours a stated ICC, which the note then names.
#[test]
fn rare_rates_from_few_templates_say_whether_an_icc_was_stated() {
    let cases = [
        (
            6.0,
            20,
            "cr2_score",
            Some("rare rate from 20 templates: the interval holds"),
            true,
        ),
        (
            115.0,
            20,
            "cr2_score",
            Some("rare rate from 20 templates: the interval holds"),
            true,
        ),
        (
            6.0,
            20,
            "cr2_score; icc=0.3",
            Some("honours the stated latent ICC 0.3"),
            false,
        ),
        (6.0, 50, "cr2_score", None, false),
        (7.0, 20, "cr2_score", None, false),
    ];
    for (sum, templates, method, note, marked) in cases {
        let mut r = ResultRow::default();
        let st = Stats {
            n: 120,
            sum,
            n_templates: templates,
            se: Some(0.02),
            lo: Some(0.01),
            hi: Some(0.2),
            method: Some(method.into()),
            naive_se: Some(0.02),
        };
        finish(&mut r, MetricKind::PassFail, &st);
        let what = format!("{sum} of 120 over {templates} templates, {method}");
        match note {
            Some(n) => assert!(
                r.note.as_deref().unwrap_or("").contains(n),
                "{what}: {:?}",
                r.note
            ),
            None => assert_eq!(r.note, None, "{what}"),
        }
        assert_eq!(r.ci_method, method);
        let page = render(&[ResultRow {
            level: "capability".into(),
            metric: "failure_rate".into(),
            model: "m".into(),
            ..r.clone()
        }]);
        assert_eq!(interval_cell(&r, true).ends_with(" ^"), marked, "{what}");
        assert_eq!(
            page.contains("^ a rate within 0.05"),
            marked,
            "{what}: {page}"
        );
    }
}

#[test]
fn a_mean_takes_the_clustered_interval() {
    let mut r = ResultRow::default();
    let st = Stats {
        n: 4,
        sum: 2.0,
        n_templates: 2,
        se: Some(0.25),
        lo: Some(0.01),
        hi: Some(0.99),
        method: Some("cr2".into()),
        naive_se: Some(0.2),
    };
    finish(&mut r, MetricKind::Numeric, &st);
    assert_eq!(r.value, Some(0.5));
    assert_eq!(
        (r.ci_lo, r.ci_hi, r.se),
        (Some(0.01), Some(0.99), Some(0.25))
    );
    // Two templates: clustered, with the note that says why the interval is wide.
    assert!(r.clustered && r.hits.is_none());
    assert_eq!(r.note, Some(few_templates_note(2)));
    assert_eq!(r.ci_method, "cr2");
}

/// The per-test table names each test's capability and, beside the interval, its
/// template count (issue 40: a one-template interval and a two-template one differ by
/// an order of magnitude, and the count says why).
#[test]
fn per_test_rows_name_their_capability_and_templates() {
    let row = |level: &str| ResultRow {
        level: level.into(),
        capability: "Negation".into(),
        test_type: "MFT".into(),
        test: Some("Neither nor".into()),
        model: "m".into(),
        metric: "failure_rate".into(),
        n: 40,
        hits: Some(3),
        value: Some(0.075),
        ci_lo: Some(0.01),
        ci_hi: Some(0.2),
        n_templates: 2,
        clustered: true,
        ..Default::default()
    };
    let out = render(&[row("capability"), row("test")]);
    let cells = |l: &str| -> Vec<String> {
        l.split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(String::from)
            .collect()
    };
    let mut lines = out.split("Per test\n").nth(1).unwrap().lines();
    assert_eq!(
        cells(lines.next().unwrap()),
        [
            "test",
            "capability",
            "type",
            "n",
            "fail",
            "fail rate",
            "95% CI",
            "templates",
            "validity"
        ]
    );
    lines.next();
    assert_eq!(
        cells(lines.next().unwrap())[..8],
        [
            "Neither nor",
            "Negation",
            "MFT",
            "40",
            "3",
            "7.5%",
            "[1.0%, 20.0%] +",
            "2"
        ]
    );
}
