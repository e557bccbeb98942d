//! Generate: expands a CheckList suite (templates x lexicons, perturbations) into the
//! `cases` table.
//!
//! Every case gets a stable content-hash `case_id`, a `template_id` (the cluster for
//! clustered standard errors) and a `group_id` tying each perturbed case to its base, so
//! no later stage needs bookkeeping. Expansion is deterministic for a given suite seed.

pub mod perturb;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, Float64Array, RecordBatch, StringArray};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use sha2::{Digest, Sha256};

use crate::pipeline::{Pipeline, PipelineError, TestConfig};
use crate::schema::Table;

/// One generated case (a row of `cases`).
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    pub case_id: String,
    pub suite: String,
    pub test: String,
    pub capability: String,
    pub test_type: String,
    pub template_id: String,
    pub group_id: String,
    pub role: String,
    pub input: String,
    pub expected: Option<String>,
    pub expectation: Option<String>,
    pub tolerance: Option<f64>,
    pub perturbation: Option<String>,
}

/// A stable id from the parts that define a case's content.
pub fn content_hash(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0u8]);
    }
    hex::encode(h.finalize())[..20].to_string()
}

/// A slot in a template: `{lexicon}`, `{lexicon2}` (a second, independent slot of the same
/// lexicon) or `{a:lexicon}` (with the indefinite article).
#[derive(Debug, Clone, PartialEq)]
struct Slot {
    key: String,
    lexicon: String,
    article: bool,
}

#[derive(Debug, Clone)]
enum Piece {
    Text(String),
    Slot(usize),
}

struct Template {
    pieces: Vec<Piece>,
    /// Distinct slot keys in order of appearance, with their word lists.
    slots: Vec<(String, Vec<String>)>,
}

fn parse_template(
    p: &Pipeline,
    test: &TestConfig,
    text: &str,
    lexicons: &BTreeMap<String, Vec<String>>,
) -> Result<Template, PipelineError> {
    let mut pieces = Vec::new();
    let mut slots: Vec<(String, Vec<String>)> = Vec::new();
    let mut slot_meta: Vec<Slot> = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find('{') {
        pieces.push(Piece::Text(rest[..open].to_string()));
        let close = rest[open..].find('}').ok_or_else(|| {
            p.invalid(
                text,
                &format!("test `{}` templates", test.name),
                format!("unclosed `{{` in template \"{text}\""),
            )
        })? + open;
        let inner = &rest[open + 1..close];
        let (article, key) = match inner.strip_prefix("a:") {
            Some(k) => (true, k),
            None => (false, inner),
        };
        let lexicon = if lexicons.contains_key(key) {
            key.to_string()
        } else {
            key.trim_end_matches(|c: char| c.is_ascii_digit())
                .to_string()
        };
        let words = lexicons.get(&lexicon).cloned().ok_or_else(|| {
            p.invalid(
                text,
                &format!("test `{}` templates", test.name),
                format!(
                    "unknown placeholder `{{{inner}}}` in template \"{text}\": no lexicon `{lexicon}` (define it under [lexicons])"
                ),
            )
        })?;
        let idx = match slots.iter().position(|(k, _)| k == key) {
            Some(i) => i,
            None => {
                slots.push((key.to_string(), words));
                slots.len() - 1
            }
        };
        slot_meta.push(Slot {
            key: key.to_string(),
            lexicon,
            article,
        });
        pieces.push(Piece::Slot(idx * 2 + usize::from(article)));
        rest = &rest[close + 1..];
    }
    pieces.push(Piece::Text(rest.to_string()));
    let _ = slot_meta;
    Ok(Template { pieces, slots })
}

fn with_article(word: &str) -> String {
    let first = word.chars().next().map(|c| c.to_ascii_lowercase());
    let an = matches!(first, Some('a' | 'e' | 'i' | 'o' | 'u'));
    format!("{} {}", if an { "an" } else { "a" }, word)
}

impl Template {
    fn size(&self) -> u128 {
        self.slots.iter().map(|(_, w)| w.len() as u128).product()
    }

    /// The `i`-th combination in mixed-radix order.
    fn fill(&self, mut i: u128) -> String {
        let mut choice = Vec::with_capacity(self.slots.len());
        for (_, words) in self.slots.iter().rev() {
            let n = words.len() as u128;
            choice.push((i % n) as usize);
            i /= n;
        }
        choice.reverse();
        let mut out = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Slot(code) => {
                    let (slot, article) = (code / 2, code % 2 == 1);
                    let w = &self.slots[slot].1[choice[slot]];
                    if article {
                        out.push_str(&with_article(w));
                    } else {
                        out.push_str(w);
                    }
                }
            }
        }
        out
    }
}

/// Expands every test of the pipeline's suite into cases.
///
/// # Errors
/// [`PipelineError`] naming the file, line and field: unknown placeholders, unknown
/// perturbations, and expansions larger than `suite.max_expansion`.
pub fn expand(p: &Pipeline) -> Result<Vec<Case>, PipelineError> {
    let mut lexicons: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for name in ["first_name", "male_name", "female_name", "city", "country"] {
        lexicons.insert(name.to_string(), perturb::builtin_lexicon(name).unwrap());
    }
    lexicons.extend(p.lexicons.clone());
    let mut out = Vec::new();
    for test in &p.tests {
        out.extend(expand_test(p, test, &lexicons)?);
    }
    Ok(out)
}

fn expand_test(
    p: &Pipeline,
    test: &TestConfig,
    lexicons: &BTreeMap<String, Vec<String>>,
) -> Result<Vec<Case>, PipelineError> {
    let suite = &p.suite.name;
    let needle = format!("\"{}\"", test.name);
    if let Some(spec) = &test.perturb
        && !perturb::OPERATORS.contains(&spec.op())
    {
        return Err(p.invalid(
            &needle,
            "test.perturb",
            format!(
                "unknown perturbation `{}` (known: {})",
                spec.op(),
                perturb::OPERATORS.join(", ")
            ),
        ));
    }
    // Base texts per template; the budget is split evenly across templates so that a
    // one-sentence template (a literal case such as "The food is not poor.") is always kept.
    let budget = test.max_cases.unwrap_or(p.suite.max_cases_per_test);
    let mut rng = SmallRng::seed_from_u64(
        p.suite.seed ^ u64::from_str_radix(&content_hash(&[suite, &test.name])[..12], 16).unwrap(),
    );
    let mut per_template: Vec<Vec<(usize, String)>> = Vec::new();
    for (ti, text) in test.templates.iter().enumerate() {
        let tpl = parse_template(p, test, text, lexicons)?;
        let size = tpl.size();
        if size > p.suite.max_expansion as u128 {
            return Err(p.invalid(
                text,
                &format!("test `{}` templates", test.name),
                format!(
                    "template \"{text}\" expands to {size} cases, above suite.max_expansion = {}",
                    p.suite.max_expansion
                ),
            ));
        }
        per_template.push((0..size).map(|i| (ti, tpl.fill(i))).collect());
    }
    let mut seen = HashSet::new();
    for list in &mut per_template {
        list.retain(|(_, t)| seen.insert(t.clone()));
    }
    let bases = allocate(per_template, budget, &mut rng);
    let tolerance = match test.test_type.as_str() {
        "MFT" => None,
        _ => Some(test.tolerance.unwrap_or(p.score.tolerance)),
    };
    let template_id = |ti: usize| format!("{}/{}/t{}", suite, test.name, ti);
    let mk = |ti: usize, role: &str, group: Option<&str>, input: String, pert: Option<String>| {
        let case_id = content_hash(&[suite, &test.name, role, group.unwrap_or(""), &input]);
        Case {
            group_id: group.map(String::from).unwrap_or_else(|| case_id.clone()),
            case_id,
            suite: suite.clone(),
            test: test.name.clone(),
            capability: test.capability.clone(),
            test_type: test.test_type.clone(),
            template_id: template_id(ti),
            role: role.to_string(),
            input,
            expected: test.expected.clone(),
            expectation: test.expectation.clone(),
            tolerance,
            perturbation: pert,
        }
    };
    let mut cases = Vec::new();
    match (&test.test_type[..], &test.perturb) {
        ("MFT", _) | (_, None) => {
            for (ti, input) in bases {
                cases.push(mk(ti, "single", None, input, None));
            }
        }
        (_, Some(spec)) => {
            for (ti, input) in bases {
                let base = mk(ti, "base", None, input.clone(), None);
                let mut crng = SmallRng::seed_from_u64(
                    p.suite.seed ^ u64::from_str_radix(&base.case_id[..12], 16).unwrap(),
                );
                let mut variants = Vec::new();
                let mut tries = 0;
                while variants.len() < test.n_perturb && tries < test.n_perturb * 5 {
                    tries += 1;
                    if let Some(v) = perturb::apply(spec, &input, &mut crng)
                        && !variants.contains(&v)
                    {
                        variants.push(v);
                    }
                }
                if variants.is_empty() {
                    continue; // the perturbation does not apply to this base case
                }
                let gid = base.case_id.clone();
                cases.push(base);
                for v in variants {
                    cases.push(mk(
                        ti,
                        "perturbed",
                        Some(&gid),
                        v,
                        Some(spec.op().to_string()),
                    ));
                }
            }
        }
    }
    if cases.is_empty() {
        return Err(p.invalid(
            &needle,
            "test",
            format!(
                "test `{}` produced no cases (does its perturbation apply to its templates?)",
                test.name
            ),
        ));
    }
    Ok(cases)
}

/// Picks at most `budget` items, splitting the budget evenly across lists (unused quota of
/// small lists goes to larger ones) and sampling within a list with `rng`. Order is kept.
fn allocate(
    lists: Vec<Vec<(usize, String)>>,
    budget: usize,
    rng: &mut SmallRng,
) -> Vec<(usize, String)> {
    let total: usize = lists.iter().map(Vec::len).sum();
    if total <= budget {
        return lists.into_iter().flatten().collect();
    }
    // Water-filling: raise a common quota until the budget is spent.
    let mut quota = vec![0usize; lists.len()];
    let mut left = budget;
    while left > 0 {
        let open: Vec<usize> = (0..lists.len())
            .filter(|&i| quota[i] < lists[i].len())
            .collect();
        if open.is_empty() {
            break;
        }
        let share = (left / open.len()).max(1);
        for i in open {
            if left == 0 {
                break;
            }
            let add = share.min(lists[i].len() - quota[i]).min(left);
            quota[i] += add;
            left -= add;
        }
    }
    let mut out = Vec::with_capacity(budget);
    for (list, q) in lists.into_iter().zip(quota) {
        if q >= list.len() {
            out.extend(list);
        } else {
            let mut idx = rand::seq::index::sample(rng, list.len(), q).into_vec();
            idx.sort_unstable();
            out.extend(idx.into_iter().map(|i| list[i].clone()));
        }
    }
    out
}

/// Builds a `cases` record batch.
pub fn to_batch(cases: &[Case]) -> RecordBatch {
    let s = |f: fn(&Case) -> &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(cases.iter().map(f)))
    };
    let o = |f: fn(&Case) -> Option<&str>| -> ArrayRef {
        Arc::new(cases.iter().map(f).collect::<StringArray>())
    };
    let cols: Vec<ArrayRef> = vec![
        s(|c| &c.case_id),
        s(|c| &c.suite),
        s(|c| &c.test),
        s(|c| &c.capability),
        s(|c| &c.test_type),
        s(|c| &c.template_id),
        s(|c| &c.group_id),
        s(|c| &c.role),
        s(|c| &c.input),
        o(|c| c.expected.as_deref()),
        o(|c| c.expectation.as_deref()),
        Arc::new(cases.iter().map(|c| c.tolerance).collect::<Float64Array>()),
        o(|c| c.perturbation.as_deref()),
    ];
    RecordBatch::try_new(Table::Cases.schema(), cols)
        .expect("cases batch matches schemas/cases.json")
}
