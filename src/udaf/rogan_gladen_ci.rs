//! `rogan_gladen_ci(pos, n, tp, fn, tn, fp [, level])`: Rogan-Gladen with a delta-method interval.

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::datatypes::{DataType, Fields};
use datafusion::common::Result;
use datafusion::logical_expr::ScalarUDF;

use super::common::{
    FunctionDoc, coerce_all_f64, f64_array, f64_col, f64_field, finite, opt_f64, struct_array,
    z_for_level,
};
use super::rogan_gladen::rogan_gladen;
use super::spec::{ScalarSpec, StatUdf};

/// The `rogan_gladen_ci` function.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct RoganGladenCi;

/// Result fields: `estimate, se, lo, hi`.
pub fn fields() -> Fields {
    Fields::from(vec![
        f64_field("estimate"),
        f64_field("se"),
        f64_field("lo"),
        f64_field("hi"),
    ])
}

/// `(estimate, se, lo, hi)`; `None` when the inputs cannot give an estimate.
///
/// Var = [p(1-p)/n + e^2 Se(1-Se)/n1 + (1-e)^2 Sp(1-Sp)/n0] / J^2 with p = pos/n, e the
/// estimate, J = Se + Sp - 1, n1 = tp + fn, n0 = tn + fp.
pub fn rogan_gladen_ci(counts: [f64; 6], level: f64) -> Option<(f64, f64, f64, f64)> {
    let [pos, n, tp, fn_, tn, fp] = counts;
    if counts.iter().any(|c| *c < 0.0) || !(level > 0.0 && level < 1.0) {
        return None;
    }
    let (n1, n0) = (tp + fn_, tn + fp);
    if !(n > 0.0 && n1 > 0.0 && n0 > 0.0 && pos <= n) {
        return None;
    }
    let (p, se_, sp) = (pos / n, tp / n1, tn / n0);
    let e = rogan_gladen(p, se_, sp)?;
    let j = se_ + sp - 1.0;
    let var = (p * (1.0 - p) / n
        + e * e * se_ * (1.0 - se_) / n1
        + (1.0 - e) * (1.0 - e) * sp * (1.0 - sp) / n0)
        / (j * j);
    let se = finite(var.max(0.0).sqrt())?;
    let z = z_for_level(level);
    Some((e, se, (e - z * se).max(0.0), (e + z * se).min(1.0)))
}

impl ScalarSpec for RoganGladenCi {
    const DOC: FunctionDoc = FunctionDoc {
        name: "rogan_gladen_ci",
        syntax: "rogan_gladen_ci(pos, n, tp, fn, tn, fp [, level])",
        returns: "Struct{estimate: Float64, se: Float64, lo: Float64, hi: Float64}",
        summary: "Rogan-Gladen corrected prevalence from `pos` scorer positives among `n` scored rows, \
                  with sensitivity tp / (tp + fn) and specificity tn / (tn + fp) from a labelled \
                  sample, and a delta-method interval: Var = [p(1-p)/n + e^2 Se(1-Se)/n1 + \
                  (1-e)^2 Sp(1-Sp)/n0] / J^2, J = Se + Sp - 1. The interval is clipped to [0, 1].",
        behavior: "The struct is never NULL; its fields are NULL when any count is NULL, NaN or \
                   negative, n, tp + fn or tn + fp is 0, pos > n, or Se + Sp <= 1. `level` defaults \
                   to 0.95.",
        arguments: &[
            ("pos", "Rows the scorer called positive in the corpus."),
            ("n", "Rows scored in the corpus."),
            ("tp", "Labelled sample: scorer positive, truly positive."),
            ("fn", "Labelled sample: scorer negative, truly positive."),
            ("tn", "Labelled sample: scorer negative, truly negative."),
            ("fp", "Labelled sample: scorer positive, truly negative."),
            ("level", "Optional confidence level, default 0.95."),
        ],
        example: "SELECT rogan_gladen_ci(13, 36, 13, 16, 7, 0) AS corrected",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        coerce_all_f64(
            Self::DOC.name,
            t,
            &["pos", "n", "tp", "fn", "tn", "fp", "level"],
            6,
        )
    }

    fn return_type(&self) -> DataType {
        DataType::Struct(fields())
    }

    fn invoke(&self, args: &[ArrayRef], n_rows: usize) -> Result<ArrayRef> {
        let a: Vec<_> = args.iter().map(f64_array).collect::<Result<_>>()?;
        let rows: Vec<Option<(f64, f64, f64, f64)>> = (0..n_rows)
            .map(|i| {
                let mut c = [0.0; 6];
                for (k, slot) in c.iter_mut().enumerate() {
                    *slot = opt_f64(a[k], i)?;
                }
                let level = a.get(6).map_or(Some(0.95), |x| opt_f64(x, i))?;
                rogan_gladen_ci(c, level)
            })
            .collect();
        struct_array(
            &fields(),
            vec![
                f64_col(rows.iter().map(|r| r.map(|r| r.0))),
                f64_col(rows.iter().map(|r| r.map(|r| r.1))),
                f64_col(rows.iter().map(|r| r.map(|r| r.2))),
                f64_col(rows.iter().map(|r| r.map(|r| r.3))),
            ],
        )
    }
}

/// The registered function.
pub fn udf() -> ScalarUDF {
    StatUdf::udf(RoganGladenCi)
}
